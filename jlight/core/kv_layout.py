"""Where each layer's K/V live in the paged pool: layers grouped by attention kind (vLLM's hybrid layout).

A model whose layers differ in attention kind (Gemma 2/3, gpt-oss: sliding-window layers beside
full-attention ones) keeps its pages per *group*: layers of one kind (one sliding window, or full
attention), each group with its own page table per sequence. A sliding-window group needs only the
pages its window still sees, so its pages are given back while the sequence runs (engine/kv_groups.py).

The layout (`group_layers`, vLLM's rule):
  * the layers of each kind are split into groups of `group_size` layers: the fewest layers of any
    kind (Gemma 3's 5 local : 1 global gives one global group and five local ones of the same size),
    or the most when no kind has 1.5x another's layers (gpt-oss's 12 : 12); layer k of a kind with n
    groups goes to group k % n, so groups are spread over the depth; the last group of a kind may be
    short (its missing layers are padding, unused memory);
  * group 0 is the full-attention group when there is one, then the windowed kinds, smallest first;
  * the pool's layer axis has `group_size` slots; slot j holds layer j of every group. A page id
    belongs to one group at a time (the engine's allocator), so page p at slot j is the K/V of layer j
    of whichever group holds p: one page id costs group_size layers of memory, whatever the group.
One kind gives one group of every layer, slot = layer index: the pool of a model without kinds.

BatchMetadata carries group 0's page table and slot mapping as always, and the other groups' in
`group_page_tables` / `group_slot_mappings` (None with one group); `layer_view` gives a layer the
slot and the metadata of its own group, which is all the attention kernels see.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

NULL_PAGE = 0  # a page-table entry a window no longer sees: the scratch page, which the kernels mask


class KVGroups(NamedTuple):
    windows: tuple  # per group: its sliding window (tokens), None for full attention
    layers: tuple  # per group: its layers in slot order (tuples of layer indices)
    group_of: tuple  # per layer: its group
    slot_of: tuple  # per layer: its slot in the pool's layer axis

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """The pool's layer axis: the largest group."""
        return max(len(g) for g in self.layers)


def group_layers(windows, by_kind: bool = True) -> KVGroups:
    """The layout of layers whose sliding windows are `windows` (one entry a layer, None: full attention).
    by_kind=False: one group of every layer that keeps every page (window None), as without kinds."""
    windows = tuple(windows)
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if not by_kind:
        kinds = [None]
    if len(kinds) == 1:
        n = len(windows)
        return KVGroups((kinds[0],), (tuple(range(n)),), (0,) * n, tuple(range(n)))
    of_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    sizes = [len(v) for v in of_kind.values()]
    group_size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    group_windows, group_members = [], []
    for w in kinds:
        members = of_kind[w]
        n = -(-len(members) // group_size)
        for i in range(n):
            group_windows.append(w)
            group_members.append(tuple(members[i::n]))
    group_of, slot_of = [0] * len(windows), [0] * len(windows)
    for g, members in enumerate(group_members):
        for j, layer in enumerate(members):
            group_of[layer], slot_of[layer] = g, j
    return KVGroups(tuple(group_windows), tuple(group_members), tuple(group_of), tuple(slot_of))


def layer_view(md, groups: KVGroups | None, layer, index: int | None = None):
    """(the layer's slot in the pool, md with its group's page table and slot mapping).

    `layer` is the layer index as the layer loop passes it (a jax int32, traced in a scanned stack);
    `index` the same as a Python int when the layer knows it (unrolled layers), which picks its group's
    arrays statically. md without group tables (one group) comes back as it is, slot = layer."""
    if md.group_page_tables is None:
        return layer, md
    if groups is None or md.group_page_tables.shape[0] != groups.num_groups - 1:
        raise ValueError(f"the batch has {md.group_page_tables.shape[0] + 1} KV groups, the model's layout "
                         f"{0 if groups is None else groups.num_groups}; build both from kv_layout.group_layers")
    if index is not None:
        group, slot = groups.group_of[index], jnp.int32(groups.slot_of[index])
        if group == 0:
            return slot, md
        return slot, md._replace(page_table=md.group_page_tables[group - 1], slot_mapping=md.group_slot_mappings[group - 1])
    group = jnp.asarray(groups.group_of, jnp.int32)[layer]
    slot = jnp.asarray(groups.slot_of, jnp.int32)[layer]
    tables = jnp.concatenate([md.page_table[None], md.group_page_tables])  # [G, B, max_pages]
    slots = jnp.concatenate([md.slot_mapping[None], md.group_slot_mappings])  # [G, T]
    return slot, md._replace(page_table=tables[group], slot_mapping=slots[group])
