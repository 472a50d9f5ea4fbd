import pytest

from runtime import InvalidProblemError, KernelSku, Precision


def test_round_trip_every_manifest_sku():
    import runtime as sf
    skus = sf.default_registry().skus()
    assert skus
    for sku in skus:
        assert KernelSku.parse(str(sku)) == sku
        assert hash(KernelSku.parse(str(sku))) == hash(sku)


def test_canonical_string_and_symbol():
    sku = KernelSku("quantization", "quantize", "token", "symmetric", "bf16", "s8")
    assert str(sku) == "quantization/quantize/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32.det.stable"
    assert sku.symbol == "sf_quantize_token_symmetric_bf16_s8_sm80_simt"
    moe = KernelSku("moe", "grouped_matmul", None, None, "bf16", None, "sm90", "mma",
                    Precision("f32", "f32", True, False))
    assert str(moe) == "moe/grouped_matmul/-/-/bf16/-/sm90/mma/f32.acc-f32.det"
    assert KernelSku.parse(str(moe)) == moe


def test_frozen_and_ordered():
    a = KernelSku("quantization", "dequantize", "token", "symmetric", "s8", "f32")
    b = KernelSku("quantization", "quantize", "token", "symmetric", "f32", "s8")
    with pytest.raises(Exception):
        a.op = "x"
    assert sorted([b, a]) == [a, b]
    assert len({a, b, KernelSku.parse(str(a))}) == 2


@pytest.mark.parametrize("text", [
    "quantization/quantize/token/symmetric/bf16/s8/sm80/simt",           # 8 fields
    "quantization/quantise/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32",  # bad op
    "quantization/quantize/row/symmetric/bf16/s8/sm80/simt/f32.acc-f32",    # bad scope
    "quantization/quantize/token/symmetric/bf17/s8/sm80/simt/f32.acc-f32",  # bad element
    "quantization/quantize/token/symmetric/bf16/s8/sm70/simt/f32.acc-f32",  # bad arch
    "quantization/quantize/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32.fast",  # bad flag
])
def test_parse_rejects_with_typed_error(text):
    with pytest.raises(InvalidProblemError):
        KernelSku.parse(text)


@pytest.mark.parametrize("fields, words", [
    (dict(category=None), ("KernelSku.category=None", "quantization, moe")),
    (dict(category="moe"), ("KernelSku.op='quantize'", "grouped_matmul")),
    (dict(op=None), ("KernelSku.op=None",)),
    (dict(element=None), ("KernelSku.element=None",)),
    (dict(element=["f32"]), ("KernelSku.element=['f32']",)),
    (dict(scope={"token"}), ("KernelSku.scope",)),
    (dict(arch=90), ("KernelSku.arch=90", "sm80")),
    (dict(backend=None), ("KernelSku.backend=None",)),
    (dict(precision="f32.acc-f32"), ("KernelSku.precision", "Precision.parse")),
])
def test_constructor_fields_are_checked(fields, words):
    base = dict(category="quantization", op="quantize", scope="token", mode="symmetric", element="bf16",
                aux_element="s8")
    with pytest.raises(InvalidProblemError) as e:
        KernelSku(**{**base, **fields})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_precision_fields_are_checked():
    for args, word in ((([],), "Precision.math"), (("f32", None), "Precision.accumulator"),
                       (("f32", "f32", "yes"), "Precision.deterministic"), (("f32", "f32", True, 1), "bit_stable")):
        with pytest.raises(InvalidProblemError, match=word):
            Precision(*args)
    for bad in (None, 3, b"f32.acc-f32"):
        with pytest.raises(InvalidProblemError, match="precision"):
            Precision.parse(bad)


def test_runs_on_takes_a_compute_capability():
    sku = KernelSku("quantization", "quantize", "token", "symmetric", "bf16", "s8")
    assert sku.runs_on(90) and not sku.runs_on(75)
    for bad in ("90", None, 9.0, True):
        with pytest.raises(InvalidProblemError, match="compute capability"):
            sku.runs_on(bad)
