"""verl's micro-batch layout in, DualKV's packed row inside, verl's layout out.

verl's actor hands ``_forward_micro_batch`` a dict of ``[B, S]`` tensors,
``S = prompt_length + response_length``: ``input_ids`` (each prompt left
padded to ``prompt_length``, each response right padded to
``response_length``), ``attention_mask`` (1 on real tokens),
``position_ids`` (0.. over the real tokens of a row) and ``responses``
``[B, response_length]``, and expects ``(entropy, log_probs)``, each
``[B, response_length]`` (log p of ``responses[b, j]``). Rows that share a
prompt (a group sampled N times) are packed once here, ``[prompt | r_1 |
... | r_N]``:

    packed = dualkv.rl.verl.pack_verl(mb["input_ids"], mb["attention_mask"],
                                      mb["position_ids"], mb["responses"])
    entropy, log_probs = dualkv.rl.verl.forward_micro_batch(
        model, mb, temperature=1.0, calculate_entropy=True)

``forward_micro_batch`` runs a transformers causal LM (registered with the
dualkv attention backend) on the packed row, computes response-only chunked
log-probs (``dualkv.rl.logprobs``) and puts them back in verl's layout;
padded response positions hold 0 (verl leaves whatever the padding's
logits give there; both are masked by the response mask).
"""

import torch

from .._bounded import shown
from ..packing import pack
from .logprobs import chunked_logprobs, gather

__all__ = ["VerlPacked", "pack_verl", "forward_micro_batch"]


class VerlPacked:
    """A verl micro-batch packed by groups: ``layout`` (dualkv.PackedGroups),
    ``rows[b] = (group, response)``, ``input_ids`` / ``position_ids``
    ``[1, T]`` and ``logit_index`` / ``targets`` ``[M]`` on the batch's
    device, ``plan()``, and ``to_verl(values)`` for ``[M]`` values in
    ``logit_index`` order -> ``[B, response_length]``."""

    def __init__(self, layout, rows, lengths, width, device):
        self.layout, self.rows, self.response_lengths = layout, rows, lengths
        self.response_width = width
        index, targets, out_rows, out_cols = [], [], [], []
        owner = {gn: b for b, gn in enumerate(rows)}
        for g, (_, rs) in enumerate(layout.groups):
            for n in range(len(rs)):
                positions = layout.logit_positions(g, n)
                index += positions
                start, stop = layout.token_range(g, n)
                targets += layout.input_ids[start:stop]
                out_rows += [owner[(g, n)]] * len(positions)
                out_cols += range(len(positions))
        as_long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.tensor(layout.input_ids, **as_long)[None]
        self.position_ids = torch.tensor(layout.position_ids, **as_long)[None]
        self.logit_index = torch.tensor(index, **as_long)
        self.targets = torch.tensor(targets, **as_long)
        self._rows = torch.tensor(out_rows, **as_long)
        self._cols = torch.tensor(out_cols, **as_long)

    def plan(self):
        return self.layout.plan()

    def to_verl(self, values):
        """[M] values (``logit_index`` order) -> [B, response_length], 0 at
        padded positions. Differentiable."""
        out = values.new_zeros(len(self.rows), self.response_width)
        return out.index_put((self._rows, self._cols), values)


def pack_verl(input_ids, attention_mask, position_ids, responses,
              group_ids=None):
    """Packs a verl micro-batch (see the module docstring). Rows are grouped
    by ``group_ids`` (one hashable per row, e.g. verl's ``uid``) or, without
    them, by identical prompts; group order and the rows' order inside a
    group are the batch's. Raises ValueError for what is not verl's layout:
    multi-dimensional position ids, padding inside a prompt or a response,
    positions that are not 0.. on a row's tokens, responses that do not
    match input_ids, rows of one group with different prompts, an empty
    prompt."""
    if position_ids.dim() != 2:
        raise ValueError(f"dualkv: position_ids has shape "
                         f"{tuple(position_ids.shape)}; verl's [B, S] layout "
                         "is needed (multi-dimensional rotary positions, "
                         "e.g. Qwen2-VL's mrope, are not supported)")
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or \
            position_ids.shape != input_ids.shape:
        raise ValueError(f"dualkv: input_ids, attention_mask and "
                         f"position_ids must all be [B, S], got "
                         f"{tuple(input_ids.shape)}, "
                         f"{tuple(attention_mask.shape)}, "
                         f"{tuple(position_ids.shape)}")
    B, S = input_ids.shape
    if responses.dim() != 2 or responses.shape[0] != B or \
            responses.shape[1] > S:
        raise ValueError(f"dualkv: responses must be [B, response_length] "
                         f"with B = {B}, response_length <= {S}; got "
                         f"{tuple(responses.shape)}")
    if group_ids is not None and len(group_ids) != B:
        raise ValueError(f"dualkv: group_ids has {len(group_ids)} entries "
                         f"for {B} rows")
    R = responses.shape[1]
    Pmax = S - R
    ids = input_ids.detach().cpu().tolist()
    mask = attention_mask.detach().cpu().bool().tolist()
    pos = position_ids.detach().cpu().tolist()
    resp = responses.detach().cpu().tolist()
    groups, keys, rows, lengths = [], {}, [], []
    for b in range(B):
        pm, rm = mask[b][:Pmax], mask[b][Pmax:]
        P = sum(pm)
        L = sum(rm)
        if P == 0:
            raise ValueError(f"dualkv: row {b} has an empty prompt")
        if not all(pm[Pmax - P:]):
            raise ValueError(f"dualkv: row {b}'s prompt has padding between "
                             "its tokens; verl left-pads prompts")
        if not all(rm[:L]):
            raise ValueError(f"dualkv: row {b}'s response has padding "
                             "between its tokens; verl right-pads responses")
        prompt = ids[b][Pmax - P:Pmax]
        response = ids[b][Pmax:Pmax + L]
        if response != resp[b][:L]:
            raise ValueError(f"dualkv: row {b}: responses[{b}] does not "
                             "match the response part of input_ids")
        if pos[b][Pmax - P:Pmax + L] != list(range(P + L)):
            raise ValueError(f"dualkv: row {b}: position_ids are not 0, 1, "
                             f"... over the row's {P + L} tokens")
        key = group_ids[b] if group_ids is not None else tuple(prompt)
        if key not in keys:
            keys[key] = len(groups)
            groups.append((prompt, []))
        g = keys[key]
        if groups[g][0] != prompt:
            raise ValueError(f"dualkv: row {b} is in group {shown(key)} but "
                             "its prompt differs from the group's first "
                             "row's")
        rows.append((g, len(groups[g][1])))
        groups[g][1].append(response)
        lengths.append(L)
    return VerlPacked(pack(groups), rows, lengths, R, input_ids.device)


def _decoder(model):
    """The base model of a causal LM (its final-normed hidden states)."""
    try:
        base = model.get_decoder()
    except (AttributeError, NotImplementedError):
        base = None
    if base is None or base is model:
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None:
        raise ValueError("dualkv: cannot find the model's decoder (no "
                         "get_decoder() and no base model attribute); pass "
                         "hidden_fn")
    return base


def forward_micro_batch(model, micro_batch, temperature=1.0,
                        calculate_entropy=False, group_ids=None, chunk=None,
                        hidden_fn=None, lm_head_weight=None):
    """verl's ``_forward_micro_batch`` on DualKV: returns ``(entropy,
    log_probs)``, each ``[B, response_length]`` fp32 (entropy None unless
    ``calculate_entropy``). ``model``: a transformers causal LM whose
    attention implementation is "dualkv" (``model.get_decoder()`` gives the
    final-normed hidden states, ``model.get_output_embeddings()`` the LM
    head, without bias). Or give ``hidden_fn(packed) -> [1, T, H]`` (final
    norm applied) and ``lm_head_weight`` [V, H] instead (model may then be
    None)."""
    packed = pack_verl(micro_batch["input_ids"], micro_batch["attention_mask"],
                       micro_batch["position_ids"], micro_batch["responses"],
                       group_ids=group_ids)
    if hidden_fn is None:
        out = _decoder(model)(input_ids=packed.input_ids,
                                  position_ids=packed.position_ids,
                                  dualkv_plan=packed.plan(), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") \
            else out[0]
    else:
        hidden = hidden_fn(packed)
    if lm_head_weight is None:
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("dualkv: an LM head with a bias is not supported")
        lm_head_weight = head.weight
    logp, entropy = chunked_logprobs(gather(hidden, packed.logit_index),
                                     lm_head_weight, packed.targets,
                                     temperature=temperature, chunk=chunk,
                                     entropy=True)
    log_probs = packed.to_verl(logp)
    return (packed.to_verl(entropy) if calculate_entropy else None), log_probs
