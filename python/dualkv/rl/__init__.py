"""DualKV's RL data pipeline (docs/rl.md).

- ``dualkv.rl.batching`` (no torch): micro-batches by token budget, groups
  split by responses when they do not fit, ranks balanced by a cost model
  of attention pairs and per-token layers (``schedule``).
- ``dualkv.Plan.from_position_ids``: the plan of a packed row from its
  rotary positions (the transformers backend uses it when no
  ``dualkv_plan`` is passed).
- ``dualkv.rl.logprobs`` (torch): response-only log-probs and entropy, the
  LM head in chunks (``response_logprobs``, ``chunked_logprobs``,
  ``unpack``).
- ``dualkv.rl.verl`` (torch): verl's padded micro-batch layout packed by
  groups and the results put back (``pack_verl``, ``forward_micro_batch``).

``import dualkv.rl`` needs no torch; the torch parts load on first use.
"""

from .batching import (CostModel, MicroBatch, PackedMicroBatch, Piece,
                       Schedule, Tree, activation_bytes_per_token, balance,
                       micro_batches, schedule, split_unit, token_budget,
                       useful_pairs)

__all__ = ["CostModel", "MicroBatch", "PackedMicroBatch", "Piece", "Schedule",
           "Tree", "activation_bytes_per_token", "balance", "micro_batches",
           "schedule", "split_unit", "token_budget", "useful_pairs",
           "chunked_logprobs", "response_logprobs", "gather", "unpack",
           "pack_verl", "forward_micro_batch", "logprobs", "verl"]

_TORCH_NAMES = {"chunked_logprobs": "logprobs", "response_logprobs": "logprobs",
                "gather": "logprobs", "unpack": "logprobs",
                "pack_verl": "verl", "forward_micro_batch": "verl"}


def __getattr__(name):
    import importlib
    if name in ("logprobs", "verl"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in _TORCH_NAMES:
        module = importlib.import_module(f"{__name__}.{_TORCH_NAMES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'dualkv.rl' has no attribute {name!r}")
