"""CPU: the host-overhead timing of codegen/harness/bench/host.py and tools/probe_host.py (the GPU runs them)."""
import importlib.util
import types
from pathlib import Path

from codegen.harness.bench import host


def test_time_host_calls_schema():
    calls, syncs = [], []
    out = host.time_host_calls([{"label": "a call", "framework": "cupy", "call": lambda: calls.append(1)},
                                {"label": "x (floor)", "call": lambda: None},
                                {"label": "part", "call": lambda: None, "target": False},
                                {"label": "broken", "call": lambda: 1 / 0}],
                               lambda: syncs.append(1), n_calls=10, repeats=3)
    assert len(calls) == 200 + 3 * 10 and len(syncs) >= 4
    a, floor, part, broken = out
    assert set(a) == {"label", "framework", "us", "min_us", "calls", "repeats", "target_us", "throughput_us", "measure"}
    assert a["target_us"] == host.TARGET_HOST_US and a["min_us"] <= a["us"] and a["measure"] == "throughput"
    assert "target_us" not in floor and "target_us" not in part
    assert broken["us"] is None and "ZeroDivisionError" in broken["error"]


def test_time_host_calls_behind_a_busy_gpu():
    """With ``busy``, ``us`` is the host's time alone: each timed batch follows one spin kernel, few
    enough launches that the queue cannot fill (fewer calls for items of several launches)."""
    calls, spins = [], []
    out = host.time_host_calls([{"label": "one", "call": lambda: calls.append(1)},
                                {"label": "four", "call": lambda: calls.append(4), "launches": 4}],
                               lambda: None, n_calls=10, repeats=3, busy=spins.append)
    one, four = out
    assert one["measure"] == four["measure"] == "host" and len(spins) == 2 * 7
    assert set(spins) == {host.HOST_BUSY_NS}
    assert one["host_calls"] == host.HOST_QUEUE and four["host_calls"] == host.HOST_QUEUE // 4
    assert calls.count(1) == 200 + 3 * 10 + 7 * host.HOST_QUEUE
    assert four["target_us"] == host.TARGET_HOST_US + 3 * host.EXTRA_LAUNCH_US
    assert one["min_us"] <= one["us"] and one["throughput_us"] > 0


def test_time_host_calls_takes_batches_in_rounds():
    """The timed batches go round the items (a, b, a, b, ...), so a slow spell of the host weighs on
    every row alike; an item that fails in a round is recorded as an error and left out after."""
    log, n_c = [], [0]

    def flaky():
        log.append("c")
        n_c[0] += 1
        if n_c[0] > 200 + 3 * 10 + 2 * host.HOST_QUEUE:     # its third timed batch fails
            raise RuntimeError("gone")

    out = host.time_host_calls([{"label": "a", "call": lambda: log.append("a")},
                                {"label": "b", "call": lambda: log.append("b")},
                                {"label": "c", "call": flaky}],
                               lambda: None, n_calls=10, repeats=3, busy=lambda ns: log.append("|"))
    timed = "".join(log[log.index("|"):]).split("|")[1:]
    assert [t[0] for t in timed] == ["a", "b", "c"] * 3 + ["a", "b"] * 4
    assert timed[8] == "c" and all(len(t) == host.HOST_QUEUE for t in timed if t != timed[8])
    a, b, c = out
    assert a["measure"] == b["measure"] == "host" and a["us"] is not None and a["host_calls"] == host.HOST_QUEUE
    assert c["us"] is None and "RuntimeError: gone" in c["error"] and "target_us" not in c


def test_host_items_dedupe_by_label_and_record_errors():
    timer = types.SimpleNamespace(spin_ns=lambda ns: None)
    m1 = types.SimpleNamespace(__name__="m1", host_calls=lambda: [{"label": "q", "call": lambda: 1}])
    m2 = types.SimpleNamespace(__name__="m2", host_calls=lambda: [{"label": "q", "call": lambda: 2},
                                                                  {"label": "r", "call": lambda: 3}])
    m3 = types.SimpleNamespace(__name__="m3", host_calls=lambda: 1 / 0)
    items, errors = host.host_items(timer, [m1, m2, m3], api=False)
    assert [i["label"] for i in items] == ["cupy RawKernel launch (floor)", "q", "r"]
    assert items[1]["call"]() == 1
    m3_error = [e for e in errors if e["label"] == "m3.host_calls()"]
    assert m3_error and m3_error[0]["us"] is None


def test_probe_script_parses_its_arguments():
    path = Path(__file__).resolve().parents[2] / "tools" / "probe_host.py"
    spec = importlib.util.spec_from_file_location("probe_host", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)        # imports nothing heavy at module level
    assert callable(mod.main) and callable(mod.components)


def test_kept_results_keeps_each_result_alive_for_the_next_calls():
    """A "results kept" host row: each call's result lives on for KEPT_RESULTS calls (new output
    addresses every call, as for a caller that keeps its results), then is released."""
    import gc
    import weakref

    from codegen.harness.workloads.base import KEPT_RESULTS, kept_results

    class Result:
        pass
    made = []

    def call(d):
        r = Result()
        made.append(weakref.ref(r))
        return r
    run = kept_results(call, None)
    for _ in range(KEPT_RESULTS + 2):
        run()
    gc.collect()
    alive = [ref() is not None for ref in made]
    assert alive == [False] * 2 + [True] * KEPT_RESULTS
