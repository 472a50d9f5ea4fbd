"""CPU: the host-overhead timing of codegen/harness/bench.py and tools/probe_host.py (the GPU runs them)."""
import importlib.util
import types
from pathlib import Path

from codegen.harness import bench


def test_time_host_calls_schema():
    calls, syncs = [], []
    out = bench.time_host_calls([{"label": "a call", "framework": "cupy", "call": lambda: calls.append(1)},
                                 {"label": "x (floor)", "call": lambda: None},
                                 {"label": "part", "call": lambda: None, "target": False},
                                 {"label": "broken", "call": lambda: 1 / 0}],
                                lambda: syncs.append(1), n_calls=10, repeats=3)
    assert len(calls) == 200 + 3 * 10 and len(syncs) >= 4
    a, floor, part, broken = out
    assert set(a) == {"label", "framework", "us", "min_us", "calls", "repeats", "target_us"}
    assert a["target_us"] == bench.TARGET_HOST_US and a["min_us"] <= a["us"]
    assert "target_us" not in floor and "target_us" not in part
    assert broken["us"] is None and "ZeroDivisionError" in broken["error"]


def test_host_items_dedupe_by_label_and_record_errors():
    timer = types.SimpleNamespace(spin_ns=lambda ns: None)
    m1 = types.SimpleNamespace(__name__="m1", host_calls=lambda: [{"label": "q", "call": lambda: 1}])
    m2 = types.SimpleNamespace(__name__="m2", host_calls=lambda: [{"label": "q", "call": lambda: 2},
                                                                  {"label": "r", "call": lambda: 3}])
    m3 = types.SimpleNamespace(__name__="m3", host_calls=lambda: 1 / 0)
    items, errors = bench.host_items(timer, [m1, m2, m3], api=False)
    assert [i["label"] for i in items] == ["cupy RawKernel launch (floor)", "q", "r"]
    assert items[1]["call"]() == 1
    assert errors[0]["label"] == "m3.host_calls()" and errors[0]["us"] is None


def test_probe_script_parses_its_arguments():
    path = Path(__file__).resolve().parent.parent / "tools" / "probe_host.py"
    spec = importlib.util.spec_from_file_location("probe_host", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)        # imports nothing heavy at module level
    assert callable(mod.main) and callable(mod.components)
