"""A tensor cut into its rows and joined back whole, in order, captured as one flatten.

``torch.cat(list(image_features), dim=0)`` (Llava's image features: a list of one tensor per image, joined for
``masked_scatter``) exports as ``unbind`` into one value per image and a ``cat`` of all of them: as many values as
the batch has images, so the program at twice the rows is another program (:mod:`fxshard.ir.twins` pairs the two
captures node by node) and a data-parallel rank could not run the one-device program on its rows.  The two ops
compute ``x.flatten(0, 1)`` (copied, as ``cat`` copies), which any batch size captures alike::

    unbind = aten.unbind.int(x)                                   # b values
    cat = aten.cat.default([unbind[0], ..., unbind[b - 1]])
    # becomes
    flatten = aten.flatten.using_ints(x, 0, 1);  cat = aten.clone.default(flatten)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten


def rejoined_rows(gm: fx.GraphModule) -> int:
    """Rewrite every ``cat(unbind(x, 0), 0)`` of ``gm`` that joins all of ``x``'s rows in order, each read there
    alone (or returned as well: the pieces the model returns are left to the output), as ``clone(flatten(x, 0,
    1))``; returns how many."""
    found = 0
    for node in list(gm.graph.nodes):
        x = _rejoined(node)
        if x is None:
            continue
        unbind = node.args[0][0].args[0]
        with gm.graph.inserting_before(node):
            flat = gm.graph.call_function(aten.flatten.using_ints, (x, 0, 1))
            copy = gm.graph.call_function(aten.clone.default, (flat,))
        for made in (flat, copy):
            made.meta = {k: v for k, v in node.meta.items() if k != "val"}
        flat.meta["val"] = node.meta["val"]
        copy.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(copy)
        pieces = list(node.args[0])
        gm.graph.erase_node(node)
        if not any(p.users for p in pieces):  # else the model returns the pieces too (Llava's image features)
            for piece in pieces:
                gm.graph.erase_node(piece)
            gm.graph.erase_node(unbind)
        found += 1
    if found:
        gm.graph.lint()
        gm.recompile()
    return found


def _rejoined(node: fx.Node) -> fx.Node | None:
    """``x`` when ``node`` is ``cat([unbind(x, 0)[0], ..., [n - 1]], 0)`` and each piece is read there alone (or
    returned)."""
    if node.op != "call_function" or node.target is not aten.cat.default or (node.args[1] if len(node.args) > 1
                                                                            else node.kwargs.get("dim", 0)) != 0:
        return None
    pieces = node.args[0]
    if not pieces or not all(isinstance(p, fx.Node) and p.target is operator.getitem for p in pieces):
        return None
    unbind = pieces[0].args[0]
    if unbind.target is not aten.unbind.int or (unbind.args[1] if len(unbind.args) > 1 else 0) != 0:
        return None
    x = unbind.args[0]
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or len(pieces) != val.shape[0]:
        return None
    if [p.args for p in pieces] != [(unbind, i) for i in range(len(pieces))] or len(unbind.users) != len(pieces) \
            or any(node not in p.users or any(u is not node and u.op != "output" for u in p.users) for p in pieces):
        return None
    return x
