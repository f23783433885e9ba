"""The fleet: engine replicas behind a router (co-located), or prefill and decode instances joined by a KV link
(disaggregated, :mod:`simulator.fleet.disagg`)."""
from __future__ import annotations

from dataclasses import dataclass

from policies.errors import require
from simulator.config.checks import at_least_zero, check_types, choice, defaults_of, named, positive

#: Router policies of a fleet (the registry is :data:`simulator.fleet.routers.ROUTERS`, checked against this on import).
ROUTER_NAMES = ("round-robin", "least-outstanding", "power-of-two", "session", "prefix-aware")
#: Links that carry the KV cache between disaggregated prefill and decode instances (the registry with their figures
#: is :data:`simulator.fleet.disagg.KV_LINKS`, checked against this on import).
KV_LINK_NAMES = ("nvlink", "infiniband", "infiniband-hdr", "ethernet")
#: The fields only disaggregated serving reads (off, they keep their defaults).
DISAGG_ONLY = ("prefill_router", "decode_router", "kv_link", "kv_link_bandwidth", "kv_link_latency")


@dataclass(frozen=True)
class FleetConfig:
    """How many engines serve, how requests reach them, and how prefill hands decode its KV cache."""

    replicas: int = 1
    """Identical engine replicas behind a router (> 0; :mod:`simulator.fleet`), each with its own scheduler, KV cache
    and policy; 1: one engine, today's results bit for bit. The run folder gains ``replicas.csv`` (per replica) and
    the summary ``replicas`` and ``load_balance_*``. On the command line, a comma list of profiles instead of a count
    makes a mixed fleet (``replica_profiles``)."""
    replica_profiles: tuple[str, ...] = ()
    """A mixed fleet: one replica per entry, each with that profile's cost model and KV blocks (a profile file, or the
    name of one in profiles/data/ without its suffix, e.g. h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b). ``--replicas
    A,B`` sets it (and ``replicas`` to its length). Kept sorted, so the order of the list changes nothing; the
    replicas are numbered in that order. Empty: ``replicas`` identical replicas of ``profile``."""
    router: str = "round-robin"
    """Router of a fleet (``replicas`` > 1): ``round-robin``, ``least-outstanding`` (fewest requests routed and not
    finished), ``power-of-two`` (the less loaded of two drawn at random), ``session`` (sticky by prompt id) or
    ``prefix-aware`` (longest cached prefix, balanced against load; needs ``enable_prefix_caching``)."""
    prefill_replicas: int = 0
    """Disaggregated prefill and decode (:mod:`simulator.fleet.disagg`; Splitwise, DistServe): this many prefill
    instances (>= 0), which only prefill, emit the first token and send the request's KV cache to one of the
    ``decode_replicas`` decode instances. Both > 0: disaggregated; both 0: off. The run folder's ``replicas.csv`` has a
    row per instance (role prefill or decode)."""
    decode_replicas: int = 0
    """Decode instances of disaggregated serving (>= 0; > 0 with ``prefill_replicas``): each receives requests with
    their KV cache (the draft's too when a draft model speculates) and decodes them with the configured policy."""
    prefill_router: str = "least-outstanding"
    """Router to the prefill instances (disaggregated serving), one of ``router``'s names."""
    decode_router: str = "least-outstanding"
    """Router to the decode instances, chosen when a prefill completes (disaggregated serving): one of ``router``'s
    names but ``prefix-aware`` (decode instances keep no prefix cache)."""
    kv_link: str = "nvlink"
    """Link that carries the KV cache from a prefill to a decode instance (disaggregated serving), per GPU:
    ``nvlink`` (NVLink 4, 450 GB/s per direction), ``infiniband`` (NDR, 50 GB/s), ``infiniband-hdr`` (HDR, 25 GB/s),
    ``ethernet`` (100 GbE, 12.5 GB/s). A transfer takes latency + bytes / (bandwidth x GPUs per instance); one prefill
    instance sends one transfer at a time."""
    kv_link_bandwidth: float | None = None
    """KV link bandwidth per GPU and direction, GB/s (1e9 bytes/s, > 0); ``None``: ``kv_link``'s datasheet figure."""
    kv_link_latency: float | None = None
    """KV link latency per transfer, seconds (>= 0); ``None``: ``kv_link``'s figure."""

    def __post_init__(self) -> None:
        check_types(self)
        positive("replicas", self.replicas)
        choice("router", self.router, ROUTER_NAMES)
        if self.replica_profiles:  # a mixed fleet: sorted (the list's order changes nothing), one replica an entry
            profiles = tuple(sorted(p.strip() for p in self.replica_profiles))
            require(len(profiles) > 1, f"config: {named('replica_profiles')} {list(profiles)}: one profile is not a "
                                       "fleet (give --profile, or two profiles or more)")
            require(self.replicas in (1, len(profiles)), f"config: {named('replicas')} {self.replicas} but "
                                                         f"{len(profiles)} replica_profiles (one replica per profile)")
            object.__setattr__(self, "replica_profiles", profiles)
            object.__setattr__(self, "replicas", len(profiles))
        self._check_disaggregation()

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on their own instances (both counts > 0)."""
        return self.prefill_replicas > 0 and self.decode_replicas > 0

    def _check_disaggregation(self) -> None:
        """Both instance counts > 0 (on) or both 0 (off); off, the other disaggregation fields keep their defaults;
        on, no co-located replicas, and decode instances keep no prefix cache to route by."""
        at_least_zero("prefill_replicas", self.prefill_replicas)
        at_least_zero("decode_replicas", self.decode_replicas)
        p, d = self.prefill_replicas, self.decode_replicas
        require(self.disaggregated or p == d == 0,
                f"config: disaggregated serving needs both {named('prefill_replicas')} and "
                f"{named('decode_replicas')} > 0 (got {p} and {d}; both 0 turns it off)")
        choice("prefill_router", self.prefill_router, ROUTER_NAMES)
        choice("decode_router", self.decode_router, ROUTER_NAMES)
        choice("kv_link", self.kv_link, KV_LINK_NAMES)
        if self.kv_link_bandwidth is not None:
            positive("kv_link_bandwidth", self.kv_link_bandwidth)
        if self.kv_link_latency is not None:
            at_least_zero("kv_link_latency", self.kv_link_latency, " s")
        if not self.disaggregated:
            defaults = defaults_of(FleetConfig)
            for name in DISAGG_ONLY:
                require(getattr(self, name) == defaults[name], f"config: {named(name)} is used only by "
                                                               "disaggregated serving (add --prefill-replicas P "
                                                               "--decode-replicas D)")
            return
        require(self.replicas == 1, f"config: {named('replicas')} {self.replicas} (co-located) with prefill_replicas "
                                    "and decode_replicas (disaggregated): give one layout")
        require(self.router == "round-robin", f"config: {named('router')} {self.router} routes co-located replicas; "
                                              "disaggregated serving routes with prefill_router and decode_router")
        require(self.decode_router != "prefix-aware", f"config: {named('decode_router')} prefix-aware: decode "
                                                      "instances keep no prefix cache")
