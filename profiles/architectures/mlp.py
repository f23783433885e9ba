"""The gated MLP of Llama-style layers: down(act(gate(x)) * up(x)), SiLU (SwiGLU: Shazeer, arXiv 2002.05202) or
GELU (Gemma-2's GeGLU) alike, ``intermediate`` wide; the dense layers of DeepSeek-V3 and GLM-4.5 and a mixture of
experts' shared experts too (:mod:`.moe`). Tensor parallelism as vLLM's ``MergedColumnParallelLinear`` /
``RowParallelLinear``: gate/up split by columns, down by rows, ``intermediate % tp == 0``; the output all-reduced.
"""
from __future__ import annotations

from dataclasses import dataclass

from profiles.architectures.base import FeedForward, Matmul, divides


@dataclass(frozen=True)
class GatedMLP(FeedForward):
    hidden: int
    intermediate: int
    bias: bool = False
    kind: str = "mlp"
    """The weight kind (:data:`profiles.architectures.base.WEIGHT_KINDS`): ``mlp``, or ``shared_experts``."""

    @property
    def params(self) -> int:
        return 3 * self.hidden * self.intermediate + (2 * self.intermediate + self.hidden if self.bias else 0)

    def device_weights(self, tp: int) -> dict[str, float]:
        return {self.kind: self.params / tp}

    def matmuls(self, tokens: int, tp: int, ep: int = 1, routing_gini: float = 0.0) -> list[Matmul]:
        weights = self.params / tp
        return [Matmul(self.kind, weights, 2 * tokens * weights)]

    def activation_elements(self, tp: int) -> float:
        """gate and up outputs, the activation-and-multiply, down's input: 6 x intermediate."""
        return 6 * self.intermediate / tp

    def check_parallel(self, tp: int, ep: int, where: str) -> None:
        divides(tp, self.intermediate, "the MLP's intermediate size", where)
