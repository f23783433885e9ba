"""Model architectures behind one description (:class:`Architecture`): the roofline (:mod:`profiles.analytical`), the
memory model and the KV-block count read it, whatever the family. Families, one a module: grouped-query attention
(:mod:`.gqa`), multi-head latent attention (:mod:`.mla`), sliding windows (:mod:`.sliding`), the gated MLP
(:mod:`.mlp`), mixtures of experts (:mod:`.moe`); weight precision (:mod:`.precision`); the registry of Hugging Face
model types (:mod:`.hf`), where a new model type is one reader.
"""
from profiles.architectures.description import Architecture

__all__ = ["Architecture"]
