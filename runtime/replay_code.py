"""The function a remembered call replays as (runtime/replay.py): written as Python source for each
:class:`Entry`, the way ``dataclasses`` writes ``__init__``, so that a repeated call runs exactly the
checks, allocations and launches its entry needs, with nothing looked up or looped over per call."""
from __future__ import annotations

import math

from . import config, status
from .graphs import LAUNCHED, MISALIGNED, bind_graph

MISS = object()         # what a replay returns where the call must take the full path


class Entry:
    """A remembered call: what to check, allocate and launch, and where the results are.
    ``go(args, vals, static)`` replays it on ``args`` (``vals``: their pointers / scalar values, a
    fresh list; ``static``: the keyword values, equal to the remembered ones): a function written
    for this entry by :func:`write_replay`; ``MISS``: run the full path instead (it raises the typed
    error, or takes over)."""

    __slots__ = ("checked", "check", "allocs", "stream", "launches", "runner", "result", "disjoint", "device",
                 "typed", "go")


def _literal(v):
    """``v`` as Python source where it reads back exactly (an int, a finite float), else None."""
    if type(v) is int or (type(v) is float and math.isfinite(v)):
        return repr(v)
    return None


def write_replay(e: Entry, nargs: int, result):
    """The replay of ``e`` as one straight-line function ``run(args, vals)``: the checks, the
    allocations, the stream, then each launch with its parameter values spelled out (constants
    inline, re-filled slots read from ``vals`` or the new allocations) and the result picked.
    The code a repeated call runs is exactly what this entry needs; nothing is looked up or looped
    over per call. ``result``: the source index (or tuple of indices, None for a None) of what the
    call returns. Each step below writes its lines of that code (and puts what they name in ``ns``)."""
    ns = {"MISS": MISS, "SYNC": config.SYNC_EVER, "sync_on": config.sync_checks_on, "W": status.words(),
          "raise_pending": status.raise_pending, "check": e.check, "get_stream": e.stream, "runner": e.runner}
    dev = int(e.device)
    src = ["def run(args, vals, static):", *_guards(e, ns, dev)]
    graph, helpers = None, []
    if e.runner is None and config.settings().graph_replay == "on":
        graph = ns["graph"] = bind_graph([prep for prep, _, _ in e.launches])
    returned = set(result if isinstance(result, tuple) else (result,))
    # work arrays (allocations the call does not return) of a graph replay: kept per stream with
    # the executable graph (runtime/graphs.py) in memory outside the framework's allocator
    # (arrays.work_allocator); under a caller's capture, new ones from the framework (the
    # captured graph owns them)
    scratch = [] if graph is None else [k for k in range(len(e.allocs)) if nargs + k not in returned]
    src += _allocations(e, ns, scratch)
    src.append("    stream = get_stream()")
    if e.runner is not None:
        src += _runner_call(e)
    else:
        calls = _call_values(e, nargs, ns, graph)
        if graph is None:
            src += [f"    go{n}(stream, {c})" for n, c in enumerate(calls)]
        elif not scratch:
            src.append(f"    graph(stream, {', '.join(calls)})")
        else:
            lines, helpers = _work_replay(e, ns, graph, scratch, calls)
            src += lines
    src.append(_returns(result, nargs))
    exec(compile("\n".join(src + helpers) + "\n", f"<skuforge replay, cuda:{dev}>", "exec"), ns)   # noqa: S102
    if helpers:
        ns["gwork"] = graph.with_work(ns["make"], ns["values"])
    return ns["run"]


def _guards(e: Entry, ns: dict, dev: int) -> list:
    """The replay's first lines: the keyword types, the debug mode, the device's status word, the
    scalar check and the disjoint arguments (each a MISS, or the pending error, where it fails)."""
    src = []
    if e.typed:
        for i, t in e.typed:
            ns[f"T{i}"] = t
        src.append("    if " + " or ".join(f"type(static[{i}]) is not T{i}" for i, _ in e.typed) + ": return MISS")
    if e.checked:
        src.append("    if SYNC[0] and sync_on(): return MISS")
    src.append(f"    w = W.words\n    if w is not None and w[{dev}]: raise_pending({dev})")
    if e.check is not None:
        src.append("    if not check(vals): return MISS")
    for i, lo_i, hi_i, j, lo_j, hi_j in e.disjoint or ():
        src.append(f"    a, b = vals[{i}], vals[{j}]\n"
                   f"    if a + {lo_i} < b + {hi_j} and b + {lo_j} < a + {hi_i}: return MISS")
    return src


def _allocations(e: Entry, ns: dict, scratch) -> list:
    """Each allocation the replay makes (``alloc<k>``; the kept work array of a graph replay:
    ``work<k>``), but the work arrays ``scratch`` (made with the graph's launch)."""
    src = []
    for k, (alloc, align, work) in enumerate(e.allocs):
        ns[f"alloc{k}"], ns[f"work{k}"] = alloc, work
        if k not in scratch:
            src.append(f"    o{k}, p{k} = alloc{k}()\n    if p{k} & 15 != {align}: return MISS")
    return src


def _source(i: int, nargs: int) -> str:
    """The object of source index ``i`` in the replay's code: an argument, else an allocation."""
    return f"args[{i}]" if i < nargs else f"o{i - nargs}"


def _runner_call(e: Entry) -> list:
    """The call of a replay by code (``Recording.set_runner``) on the arguments and allocations."""
    src = []
    news = "".join(f"o{k}, " for k in range(len(e.allocs)))
    if e.allocs:
        src.append("    vals.extend((" + "".join(f"p{k}, " for k in range(len(e.allocs))) + "))")
    src.append(f"    runner((*args, {news}None), vals, stream)")
    return src


def _call_values(e: Entry, nargs: int, ns: dict, graph) -> list:
    """Each launch's parameter values as a tuple expression (``go<n>``: its bound launch, where the
    replay does not launch a graph)."""
    calls = []
    for n, (prep, template, slots) in enumerate(e.launches):
        if graph is None:
            ns[f"go{n}"] = prep.bound()
        parts = []
        for j, v in enumerate(template):
            f = slots.get(j)
            if f is not None:
                i, off, encode = f
                expr = f"vals[{i}]" if i < nargs else f"p{i - nargs}"
                if off:
                    expr = f"{expr} + {off}"
                if encode is not None:
                    ns[f"m{n}_{j}"] = encode
                    expr = f"m{n}_{j}({expr})"
                parts.append(expr)
            else:
                lit = _literal(v)
                if lit is None:
                    ns[f"c{n}_{j}"] = v
                    lit = f"c{n}_{j}"
                parts.append(lit)
        calls.append(f"({', '.join(parts)},)")
    return calls


def _work_replay(e: Entry, ns: dict, graph, scratch, calls) -> tuple:
    """(lines, helpers) of a graph replay with work arrays: one ``graph.with_work`` call (``gwork``);
    under a caller's capture, new work arrays and one launch per kernel (``gone``)."""
    ns.update(gone=graph.one_by_one, LAUNCHED=LAUNCHED, MISALIGNED=MISALIGNED)
    news = [k for k in range(len(e.allocs)) if k not in scratch]     # the returned ones
    fresh = "".join(f"alloc{k}(), " for k in scratch)      # a capture's: the framework's
    kept = "".join(f"work{k}(stream), " for k in scratch)  # kept ones: arrays.work_allocator
    got = "".join(f"(o{k}, p{k}), " for k in scratch)
    misaligned = " or ".join(f"p{k} & 15 != {e.allocs[k][1]}" for k in scratch)
    unpack = f"    {''.join(f'p{k}, ' for k in news)}= news\n" if news else ""
    # the kept work arrays are made on a stream's first graph launch (make), and the node
    # values are written with them (values), inside the one call of graph.with_work
    src = ["    r = gwork(stream, vals, (" + "".join(f"p{k}, " for k in news) + "))",
           "    if r != LAUNCHED:",
           "        if r == MISALIGNED: return MISS",
           f"        {got}= {fresh}",
           f"        if {misaligned}: return MISS",
           f"        gone(stream, {', '.join(calls)})"]
    helpers = ["def make(stream):",
               f"    kept = {kept}",
               f"    {got}= kept",
               f"    return None if {misaligned} else kept",
               "def values(vals, news, kept):",
               unpack + f"    {got}= kept",
               f"    return ({', '.join(calls)},)"]
    return src, helpers


def _returns(result, nargs: int) -> str:
    """The replay's last line: what the call returns."""
    if isinstance(result, tuple):
        return "    return (" + "".join(("None" if i is None else _source(i, nargs)) + ", " for i in result) + ")"
    return f"    return {_source(result, nargs)}"
