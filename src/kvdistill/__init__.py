"""kvdistill: multi-teacher KV-cache distillation with 4D alignment for causal LMs."""

__version__ = "0.1.0"
