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
