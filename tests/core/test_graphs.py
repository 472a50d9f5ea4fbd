"""The multi-launch replay as one CUDA graph launch (runtime/graphs.py), over the graph calls of a fake
device (tests/fakes.py) that record what they are given."""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import pytest

from runtime import device, graphs
from tests.fakes import FakeDevice


@dataclass
class _Fn:
    ptr: int


@dataclass
class _Abi:
    fmt: str


@dataclass
class _Prep:
    fn: _Fn
    grid: tuple
    block: tuple
    abi: _Abi
    values: list
    shared_mem: int = 0
    launched: list = None

    def bound(self):          # PreparedLaunch.bound(): the launch on a stream
        return lambda stream, values: self.launched.append((self.fn.ptr, stream, tuple(values)))


class _Driver:
    """The graph calls of libcuda, recorded: node parameters are read back from the packed blocks."""

    def __init__(self, fail=()):
        self.log, self.fail, self.nodes, self.n = [], set(fail), {}, 0
        self.capturing = set()        # streams being captured

    def _handle(self):
        self.n += 1
        return 0x1000 * self.n

    def fns(self):
        def create(g, flags):
            if "cuGraphCreate" in self.fail:
                return 1
            g._obj.value = self._handle()
            return 0

        def add(node, graph, deps, ndeps, kp):
            h = self._handle()
            node._obj.value = h
            self.nodes[h] = kp._obj
            self.log.append(("add", self._read(kp._obj), ndeps.value))
            return 0

        def instantiate(ex, graph, flags):
            ex._obj.value = self._handle()
            self.log.append(("instantiate", ex._obj.value))
            return 0

        def setp(ex, node, kp):
            self.log.append(("set", ex.value, self._read(kp._obj)))
            return 0

        def launch(ex, stream):          # CuPy's runtime.graphLaunch: ints, raises on an error
            if "graphLaunch" in self.fail:
                raise RuntimeError("cudaErrorInvalidResourceHandle")
            self.log.append(("launch", ex, stream))

        def is_capturing(stream):        # CuPy's runtime.streamIsCapturing
            if "streamIsCapturing" in self.fail:
                raise RuntimeError("cudaErrorStreamCaptureImplicit")
            return stream in self.capturing
        return {"streamIsCapturing": is_capturing, "cuGraphCreate": create, "cuGraphAddKernelNode_v2": add,
                "cuGraphInstantiateWithFlags": instantiate, "graphLaunch": launch,
                "cuGraphExecKernelNodeSetParams_v2": setp, "cuGraphExecDestroy": lambda ex: 0,
                "cuGraphDestroy": lambda g: 0}

    @staticmethod
    def _read(kp):
        """(function, grid x, the first parameter as packed): what the node would launch."""
        first = ctypes.cast(kp.kernelParams, ctypes.POINTER(ctypes.c_void_p))[0]
        return kp.func, kp.gridDimX, struct.unpack("Q", ctypes.string_at(first, 8))[0]


@pytest.fixture
def driver():
    d = _Driver()
    d.calls = d.fns()
    with device.use(FakeDevice(graphs=d.calls)):
        yield d


def _preps(launched=None):
    launched = [] if launched is None else launched
    return [_Prep(_Fn(0xA0), (3,), (128,), _Abi("Qi"), [0x500, 7], launched=launched),
            _Prep(_Fn(0xB0), (5,), (256,), _Abi("QQf"), [0x600, 0x700, 1.5], launched=launched)]


def test_graph_is_a_chain_of_the_launches(driver):
    go = graphs.bind_graph(_preps())
    assert go is not None
    adds = [e for e in driver.log if e[0] == "add"]
    assert adds == [("add", (0xA0, 3, 0x500), 0), ("add", (0xB0, 5, 0x600), 1)]   # the second after the first


def test_replay_sets_only_the_changed_nodes_then_launches_once(driver):
    go = graphs.bind_graph(_preps())
    driver.log.clear()
    go(11, (0x500, 7), (0x600, 0x700, 1.5))            # the values the graph was made with: nothing to set
    assert [e[0] for e in driver.log] == ["instantiate", "launch"]
    ex = driver.log[0][1]
    driver.log.clear()
    go(11, (0x500, 7), (0x900, 0x700, 1.5))            # second node re-pointed
    assert driver.log == [("set", ex, (0xB0, 5, 0x900)), ("launch", ex, 11)]
    driver.log.clear()
    go(11, (0x500, 7), (0x900, 0x700, 1.5))            # same again: launch only
    assert driver.log == [("launch", ex, 11)]


def test_each_stream_has_its_own_executable_graph(driver):
    go = graphs.bind_graph(_preps())
    go(11, (0x500, 7), (0x600, 0x700, 1.5))
    go(12, (0x500, 7), (0x600, 0x700, 1.5))
    launches = [e for e in driver.log if e[0] == "launch"]
    assert launches[0][2] == 11 and launches[1][2] == 12 and launches[0][1] != launches[1][1]


def test_one_launch_is_a_graph_of_one_node(driver):
    go = graphs.bind_graph(_preps()[:1])
    go(11, (0x500, 7))
    assert [e[0] for e in driver.log] == ["add", "instantiate", "launch"]


def test_a_stream_being_captured_gets_the_kernels_one_by_one(driver):
    launched = []
    go = graphs.bind_graph(_preps(launched))
    driver.capturing.add(11)
    driver.log.clear()
    go(11, (0x500, 7), (0x900, 0x700, 1.5))
    assert driver.log == [] and launched == [(0xA0, 11, (0x500, 7)), (0xB0, 11, (0x900, 0x700, 1.5))]
    driver.capturing.clear()
    go(11, (0x500, 7), (0x900, 0x700, 1.5))            # then a graph launch again, the node re-pointed
    assert [e[0] for e in driver.log] == ["instantiate", "set", "launch"] and len(launched) == 2


def test_no_graph_where_the_driver_refuses():
    with device.use(FakeDevice(graphs=_Driver(fail={"cuGraphCreate"}).fns())):
        assert graphs.bind_graph(_preps()) is None
    with device.use(FakeDevice(graphs=_Driver().fns())):
        assert graphs.bind_graph([]) is None
        assert graphs.bind_graph(_preps()) is not None
    with device.use(FakeDevice(graphs=None)):                # no libcuda
        assert graphs.bind_graph(_preps()) is None


def test_a_refused_instantiation_is_a_typed_error(driver):
    from runtime.errors import SkuforgeError
    go = graphs.bind_graph(_preps())
    driver.calls["cuGraphInstantiateWithFlags"] = lambda ex, g, flags: 2      # out of memory
    with pytest.raises(SkuforgeError, match="cuGraphInstantiateWithFlags failed: CUresult 2"):
        go(11, (0x500, 7), (0x600, 0x700, 1.5))


def test_a_replay_with_work_arrays_keeps_them_per_stream_in_one_call(driver):
    """``with_work(make, values_of)``: one call per replay makes the stream's work arrays on its
    first graph launch there (``make``), writes the node values with them (``values_of``), sets
    and launches; a stream being captured launches nothing (the caller launches the kernels on
    new work arrays); a misaligned work array launches nothing."""
    launched, made, seen = [], [], []
    go = graphs.bind_graph(_preps(launched))

    def make(stream):
        made.append(stream)
        return (0x900 + stream,)

    def values_of(vals, news, kept):
        seen.append((vals, news, kept))
        return (vals[0], 7), (kept[0], news[0], 1.5)
    launch = go.with_work(make, values_of)
    driver.log.clear()
    assert launch(11, [0x500], (0x700,)) == graphs.LAUNCHED
    ex = driver.log[0][1]
    assert driver.log == [("instantiate", ex), ("set", ex, (0xB0, 5, 0x900 + 11)), ("launch", ex, 11)]
    driver.log.clear()
    assert launch(11, [0x500], (0x800,)) == graphs.LAUNCHED        # the same work array, a new output
    assert made == [11] and seen[-1] == ([0x500], (0x800,), (0x900 + 11,))
    assert driver.log == [("set", ex, (0xB0, 5, 0x900 + 11)), ("launch", ex, 11)]
    assert launch(12, [0x500], (0x700,)) == graphs.LAUNCHED        # another stream: its own
    assert made == [11, 12] and driver.log[-1][2] == 12 and driver.log[-1][1] != ex
    driver.capturing.add(13)
    driver.log.clear()
    assert launch(13, [0x500], (0x700,)) == graphs.CAPTURING and driver.log == [] and made == [11, 12]
    go.one_by_one(13, (0x500, 7), (0x900, 0x700, 1.5))
    assert launched == [(0xA0, 13, (0x500, 7)), (0xB0, 13, (0x900, 0x700, 1.5))] and driver.log == []
    misaligned = go.with_work(lambda stream: None, values_of)
    assert misaligned(14, [0x500], (0x700,)) == graphs.MISALIGNED
    assert [e[0] for e in driver.log] == ["instantiate"]            # nothing set or launched
    assert misaligned(14, [0x500], (0x700,)) == graphs.MISALIGNED   # and nothing kept


def test_a_stream_the_runtime_cannot_tell_about_gets_the_kernels_one_by_one(driver):
    """cudaStreamIsCapturing refused (an invalidated capture; the legacy stream while another
    stream captures): no graph launch, which would invalidate a capture; the kernels report."""
    launched = []
    go = graphs.bind_graph(_preps(launched))
    driver.fail.add("streamIsCapturing")
    driver.log.clear()
    go(11, (0x500, 7), (0x600, 0x700, 1.5))
    assert driver.log == [] and len(launched) == 2
    assert go.with_work(lambda stream: (0x900,), lambda v, n, k: ())(11, [], ()) == graphs.CAPTURING


def test_a_refused_graph_launch_is_a_typed_error(driver):
    from runtime.errors import SkuforgeError
    go = graphs.bind_graph(_preps())
    driver.fail.add("graphLaunch")
    with pytest.raises(SkuforgeError, match="cudaGraphLaunch failed: cudaErrorInvalidResourceHandle"):
        go(11, (0x500, 7), (0x600, 0x700, 1.5))


def test_values_that_come_back_get_an_executable_graph_of_their_own(driver):
    """A set of node values seen again after the floating executable graph moved on gets its own
    executable graph; later replays with it launch that graph and set nothing."""
    go = graphs.bind_graph(_preps())
    a, b = ((0x500, 7), (0x600, 0x700, 1.5)), ((0x500, 7), (0x900, 0x700, 1.5))
    go(11, *a)                                   # the values the graph was made with
    floating = driver.log[-1][1]
    go(11, *b)                                   # first seen: the floating graph is re-set
    go(11, *a)                                   # back, but a was not seen while another was held
    driver.log.clear()
    go(11, *b)                                   # b comes back: its own graph, set from the made values
    fixed = driver.log[0][1]
    assert driver.log == [("instantiate", fixed), ("set", fixed, (0xB0, 5, 0x900)), ("launch", fixed, 11)]
    driver.log.clear()
    for _ in range(3):
        go(11, *a)
        go(11, *b)
    assert driver.log == [("launch", floating, 11), ("launch", fixed, 11)] * 3     # nothing set
    go(12, *b)                                   # another stream: its own graphs
    assert driver.log[-1][1] not in (floating, fixed)


def test_fixed_executable_graphs_are_bounded(driver, monkeypatch):
    """Past ``FIXED`` a stream (or ``FIXED_TOTAL`` the process), a replay re-sets the floating
    graph; destroying a graph's executables gives their count back."""
    monkeypatch.setattr(graphs, "FIXED", 1)
    go = graphs.bind_graph(_preps())
    sets = [((0x500, 7), (0x600 + 0x100 * i, 0x700, 1.5)) for i in range(3)]
    for _ in range(3):
        for v in sets:
            go(11, *v)
    instantiated = [e for e in driver.log if e[0] == "instantiate"]
    assert len(instantiated) == 2                # the floating graph and one fixed
    st = go.graph.execs[11]
    assert len(st.fixed) == 1 and len(st.owned) == 1
    before = graphs.fixed().count
    monkeypatch.setattr(graphs, "FIXED", 32)
    monkeypatch.setattr(graphs, "FIXED_TOTAL", before)      # the process is full: no new fixed graph
    driver.log.clear()
    go(11, *sets[2])
    go(11, *sets[1])
    go(11, *sets[2])
    assert [e[0] for e in driver.log if e[0] == "instantiate"] == []
    go.graph._destroy(go.graph.execs.pop(11))
    assert graphs.fixed().count == before - 1


def test_work_arrays_are_shared_by_a_streams_executable_graphs(driver):
    go = graphs.bind_graph(_preps())
    made = []

    def make(stream):
        made.append(stream)
        return (0x900,)
    launch = go.with_work(make, lambda vals, news, kept: ((vals[0], 7), (kept[0], news[0], 1.5)))
    for out in (0x700, 0x800, 0x700, 0x800, 0x700, 0x800):      # two outputs in turn
        assert launch(11, [0x500], (out,)) == graphs.LAUNCHED
    assert made == [11]
    launches = [e[1] for e in driver.log if e[0] == "launch"]
    assert len(set(launches)) == 2 and launches[-2:] == launches[-4:-2]
    assert not [e for e in driver.log[-4:] if e[0] == "set"]           # settled: nothing set


def test_values_that_cannot_be_hashed_use_the_floating_graph(driver):
    """A parameter value the driver takes but a dict cannot (a bytearray tensor map): the floating
    graph is re-set, no fixed graph is made, nothing fails."""
    launched = []
    preps = [_Prep(_Fn(0xA0), (3,), (128,), _Abi("QT"), [0x500, bytes(128)], launched=launched)]
    go = graphs.bind_graph(preps)
    a, b = (0x500, bytearray(128)), (0x600, bytearray(b"\1" * 128))
    for v in (a, b, a, b):
        go(11, v)
    assert [e[0] for e in driver.log].count("instantiate") == 1
    assert [e[0] for e in driver.log].count("set") == 3         # a equals the values made with
