"""Graph / module rewrites: each module is one pattern, one replacement and
one check, and counts how often it fired so tests can prove it."""
from __future__ import annotations

from typing import Callable


def example_value(node):
    """The fake tensor dynamo recorded for a graph node (None for constants)."""
    import torch.fx
    if isinstance(node, torch.fx.Node):
        return node.meta.get("example_value")
    return None


def replace_calls(gm, targets, replacement: Callable, stats) -> int:
    """Swap each ``call_function`` node whose target is in ``targets`` for
    ``replacement(node)`` -> (op, args), or leave it when that returns None.
    Counts graph_fired / graph_declined in ``stats``; returns how many fired."""
    fired = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        new_call = replacement(node)
        if new_call is None:
            stats["graph_declined"] += 1
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(*new_call)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        fired += 1
    if fired:
        gm.graph.lint()
        gm.recompile()
    stats["graph_fired"] += fired
    return fired
