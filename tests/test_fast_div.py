"""The writes' hoisted division (codegen.render.fast_division; recip_fast / div_fast in the generated kernels):
compiled with FAST_DIV, a write stores the bytes it stores without it. GPU only: the interpreter always divides with
div_rn. benchmarks/check_fast_div.py checks the division itself over every fp16 scale."""

from __future__ import annotations

import os

import pytest
import torch

import kvgen
from kvgen.runtime import kernels as K

on_gpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "0" or not torch.cuda.is_available(),
                            reason="compiled kernels: run with TRITON_INTERPRET=0 on a GPU")
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def test_fast_division_where_the_scales_allow():
    """The sides that take it: integer codes divided per element; always for fp16 scales (q4_0, KIVI), behind a test
    of each tile's scales for fp32 or global scales (int8 asym, int4 per token-head, rotated); e2m1 codes of fp8
    scales times a global scale through each scale's power of two (nvfp4); not for other float codes, power-of-two
    scales (a multiply), static scales, or rotated float codes' fp64 quotient."""
    from kvgen.codegen.render import FAST_ALWAYS, FAST_GUARDED, FAST_SCALED, fast_division
    verdicts = {}
    for name in kvgen.shipped_names():
        spec = kvgen.load(name).spec
        for side in {fast_division(spec.key), fast_division(spec.value)} - {""}:
            verdicts.setdefault(side, set()).add(name)
    assert verdicts == {FAST_ALWAYS: {"q4_0", "q4_0_separate", "kivi_2bit", "kivi_4bit"},
                        FAST_GUARDED: {"int8_asym_per_token_head", "int8_asym_per_token_head_separate",
                                       "int4_per_token_head", "int4_per_token_head_separate"},
                        FAST_SCALED: {"nvfp4", "nvfp4_separate"}}


def boundary_tokens(tokens: int, heads: int, head: int, gen: torch.Generator) -> torch.Tensor:
    """Blocks of 32 whose largest magnitude is 7 * s for an fp16 s, the others at code boundaries (k + 0.5) * s a few
    fp32 ulps either side, plus random values: the divisions that decide between two codes."""
    shape = (tokens, heads, head // 32, 1)
    s = (torch.rand(shape, generator=gen) + 1.0).half().float()  # fp16 values: 7 * s is exact, and 7 * s / 7 is s
    s = torch.ldexp(s, torch.randint(-12, 12, shape, generator=gen))
    k = torch.randint(-7, 7, (tokens, heads, head // 32, 32), generator=gen).float() + 0.5  # |k| <= 6.5
    x = ((k * s).view(torch.int32) + torch.randint(-3, 4, k.shape, generator=gen, dtype=torch.int32)).view(torch.float32)
    noise = torch.rand(x.shape, generator=gen) < 0.25
    x = torch.where(noise, (torch.rand(x.shape, generator=gen) * 14.0 - 7.0) * s, x)
    x[..., 0] = 7.0 * s[..., 0]  # the block's largest magnitude: its scale is s
    return x.reshape(tokens, heads, head)


def bytes_with_and_without(monkeypatch, name: str, key, value, slots, **scales) -> list:
    """The cache tensors after one write with FAST_DIV off, then on (static scales as given)."""
    fmt = kvgen.load(name)
    stored = []
    for fast in (False, True):
        monkeypatch.setattr(K, "FAST_DIV", fast)
        cache = fmt.allocate(key.shape[0] // 16, 16, key.shape[1], key.shape[2], device="cuda", **scales)
        for n, t in cache.tensors.items():
            if n not in ("k_scale", "v_scale"):
                t.zero_()
        fmt.write(cache, key, value, slots)
        stored.append({n: t.clone() for n, t in cache.tensors.items()})
    return stored


def assert_same(stored: list) -> None:
    for n in stored[0]:
        assert torch.equal(stored[0][n], stored[1][n]), n


@on_gpu
def test_fast_div_writes_the_same_bytes(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, head = 4096, 8, 128
    key, value = (boundary_tokens(tokens, heads, head, gen).cuda() for _ in range(2))
    slots = torch.randperm(tokens, generator=gen).cuda()
    assert_same(bytes_with_and_without(monkeypatch, "q4_0", key, value, slots))


def wide_tokens(tokens: int, heads: int, head: int, tile: int, gen: torch.Generator) -> torch.Tensor:
    """Random values scaled by 2**(e + f): e in [-40, 40] per write tile of `tile` tokens, f in [-3, 3] per block of
    16, so some tiles' scales all lie in render.FAST_SCALE_RANGE (div_fast) and others' do not (div_rn); one value in
    eight +-0. Then the cases where div_fast alone would give other codes, in tiles that must take div_rn: |x| >=
    2**64 with scales between 2**17 and 2**100 (div_rn: x / s in the code range; div_fast would keep x, code 255 or
    0), and +-3e38 (the range overflows: an infinite scale)."""
    e = torch.randint(-40, 41, (tokens // tile, 1, 1, 1, 1), generator=gen).float()
    f = torch.randint(-3, 4, (tokens // tile, tile, heads, head // 16, 1), generator=gen).float()
    x = torch.randn(tokens // tile, tile, heads, head // 16, 16, generator=gen) * torch.exp2(e + f)
    zero = torch.rand(x.shape, generator=gen) < 0.125
    x = torch.where(zero, torch.where(torch.rand(x.shape, generator=gen) < 0.5, -0.0, 0.0), x)
    x = x.reshape(tokens, heads, head)
    big = torch.exp2(torch.randint(64, 100, (64, heads, 1), generator=gen).float())  # the range's top end
    x[:64] = torch.rand(64, heads, head, generator=gen) * big  # |x| in [0, 2**100): scales up to 2**100 / 255
    x[:64, :, 0] = -big[..., 0]  # one element at -2**64 or below in every token and head
    x[64:72, :, 5] = 3e38
    x[64:72, :, 6] = -3e38  # hi - lo overflows
    return x


@on_gpu
def test_guarded_fast_div_writes_the_same_bytes(monkeypatch):
    """int8 asym: fp32 scales per token and head, max((max - min) / 255, 1e-6); a write tile takes div_fast where
    all its scales lie in [2**-30, 2**17]. The data holds both kinds of tile (checked with margins of 2**2), and the
    values that div_fast would get wrong (wide_tokens), which the guard must send to div_rn."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, head = 4096, 8, 128
    fmt = kvgen.load("int8_asym_per_token_head")
    tile = K.write_tiles(fmt._kernels.module.CODE_BITS, fmt._kernels.pow2_blocks)["BLOCK_T"]  # tokens per program
    key, value = (wide_tokens(tokens, heads, head, tile, gen).cuda() for _ in range(2))
    slots = torch.randperm(tokens, generator=gen).cuda()
    for x in (key, value):
        s = ((x.amax(dim=2).clamp(min=0) - x.amin(dim=2).clamp(max=0)) / 255).clamp(min=1e-6)  # [tokens, heads]
        s = s.reshape(tokens // tile, tile, heads)
        inside = ((s >= 2.0 ** -28) & (s <= 2.0 ** 15)).all(dim=1)  # [tiles, heads]
        outside = (s > 2.0 ** 19).any(dim=1)
        assert inside.sum() > 1000 and outside.sum() > 1000, (int(inside.sum()), int(outside.sum()))
    assert_same(bytes_with_and_without(monkeypatch, "int8_asym_per_token_head", key, value, slots))


def e2m1_tokens(tokens: int, heads: int, head: int, g: float, gen: torch.Generator) -> torch.Tensor:
    """nvfp4 inputs for a global scale g: in each block of 16 the largest magnitude is 6 * s * g for an fp8 e4m3 s
    (so the block's scale is s, exactly), the others a few fp32 ulps either side of the e2m1 ties t * s * g (t in
    0.25, 0.75, ..., 5), or random; s over all of e4m3's binades. Then the inputs where the division's fast path
    leaves its range: +-inf and +-3e38 (NaN or inf quotients, which must saturate with x's sign), |x| from 2**64 up,
    fp32 subnormals and +-0."""
    blocks = (tokens, heads, head // 16, 1)
    s = torch.ldexp(1.0 + torch.randint(0, 8, blocks, generator=gen).float() / 8,
                    torch.randint(-6, 9, blocks, generator=gen))  # e4m3 normals from 2**-6 to 480 (saturates)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    t = ties[torch.randint(0, 7, (tokens, heads, head // 16, 16), generator=gen)]
    t = t * torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0)
    x = (t * s * g).view(torch.int32) + torch.randint(-2, 3, t.shape, generator=gen, dtype=torch.int32)
    x = x.view(torch.float32)
    noise = torch.rand(x.shape, generator=gen) < 0.25
    x = torch.where(noise, (torch.rand(x.shape, generator=gen) * 12 - 6) * s * g, x)
    x[..., 0] = 6.0 * s[..., 0] * g
    x = x.reshape(tokens, heads, head)
    x[:8, :, 1], x[:8, :, 2], x[:8, :, 3], x[:8, :, 4] = float("inf"), float("-inf"), 3e38, -3e38
    x[8:16, :, 1:9] = torch.ldexp(torch.rand(8, heads, 8, generator=gen) + 1, torch.randint(64, 127, (8, heads, 8),
                                                                                             generator=gen))
    x[16:24, :, 1:5] = torch.tensor([1e-45, -1e-40, 0.0, -0.0])
    return x


@on_gpu
@pytest.mark.parametrize("g", [2.0 ** -32, 3 * 2.0 ** -20, 1.0, 0.7, 1.7 * 2.0 ** 20, 2.0 ** 32])
def test_scaled_fast_div_writes_the_same_bytes(monkeypatch, g):
    """nvfp4 (render.fast_division "scaled"): each group's scale split into s' in [1, 2) and a power of two, no test
    of |x|; the same bytes as div_rn for global scales across GLOBAL_SCALE_RANGE, ties and out-of-range inputs."""
    gen = torch.Generator().manual_seed(2)
    tokens, heads, head = 1024, 4, 128
    key, value = (e2m1_tokens(tokens, heads, head, g, gen).cuda() for _ in range(2))
    slots = torch.randperm(tokens, generator=gen).cuda()
    for name in ("nvfp4", "nvfp4_separate"):
        assert_same(bytes_with_and_without(monkeypatch, name, key, value, slots, k_scale=g, v_scale=g))


def test_global_scales_outside_their_range_are_refused():
    fmt = kvgen.load("nvfp4")
    for g in (2.0 ** -32, 1.0, 2.0 ** 32):
        fmt.allocate(2, 16, 1, 64, k_scale=g, v_scale=1.0)
    for g in (2.0 ** -33, 1e-20, 2.0 ** 33):
        with pytest.raises(ValueError, match=r"k_scale: a global scale must lie in \[2\*\*-32, 2\*\*32\]"):
            fmt.allocate(2, 16, 1, 64, k_scale=g, v_scale=1.0)
        with pytest.raises(ValueError, match=r"v_scale: a global scale must lie"):
            fmt.allocate(2, 16, 1, 64, k_scale=1.0, v_scale=g)


def test_a_global_scale_copied_in_after_allocate_is_checked_on_write(monkeypatch):
    """An engine may load the layer's scales into the cache's tensors after allocating it: write's costly checks (which
    run on CPU tensors, and on the GPU under KVGEN_DEBUG) catch one out of range before any byte is written."""
    from kvgen.runtime import checks

    monkeypatch.setattr(checks, "DEBUG", True)
    fmt = kvgen.load("nvfp4")
    cache = fmt.allocate(2, 16, 1, 64, k_scale=1.0, v_scale=1.0, device=DEVICE)
    x, slots = torch.ones(3, 1, 64, device=DEVICE), torch.arange(3, device=DEVICE)
    fmt.write(cache, x, x, slots)
    before = cache.tensors["kv_cache"].clone()
    cache.tensors["v_scale"].fill_(2.0 ** 40)
    with pytest.raises(ValueError, match=r"cache.tensors\['v_scale'\]: a global scale must lie"):
        fmt.write(cache, 2 * x, 2 * x, slots)
    assert torch.equal(cache.tensors["kv_cache"], before)


def _side(element="int4", rotation=False, **scale):
    from kvgen.codegen.spec import SideSpec

    side = {"element": element, "scale": {"granularity": "per_block", "block": 32, "dtype": "fp16", "apply": "divide",
                                          **scale}}
    if rotation:
        side["rotation"] = {"kind": "hadamard", "seed": 0}
    return SideSpec.model_validate(side)


@pytest.mark.parametrize("side,verdict", [
    (dict(), "always"),  # fp16 scales: [2**-24, 65504]
    (dict(min=1e-12), "always"),  # a floor below fp16's smallest: the dtype's smallest holds
    (dict(element="int8", dtype="fp32"), "guarded"),
    (dict(dtype="bf16"), "guarded"),
    (dict(dtype="fp8_e4m3"), "guarded"),  # codecs.SCALE_MAX gives fp8 scales no bound: the tile's test decides
    (dict(global_scale=True), "guarded"),  # times a runtime global scale
    (dict(dtype="e8m0"), ""),  # powers of two: x times the exact reciprocal
    (dict(dtype="e8m0", global_scale=True), "guarded"),
    (dict(element="fp8_e4m3"), ""),  # float codes
    (dict(element="fp4_e2m1", dtype="fp8_e4m3"), ""),  # float codes without a global scale (measured no faster)
    (dict(element="fp4_e2m1", dtype="fp8_e4m3", global_scale=True), "scaled"),  # nvfp4
    (dict(element="fp4_e2m1", dtype="fp16", global_scale=True), "scaled"),  # 65504 * 2**32 < 2**60
    (dict(element="fp4_e2m1", dtype="bf16", global_scale=True), ""),  # bf16 scales reach 2**128
    (dict(element="fp8_e4m3", global_scale=True), ""),  # its encode does not saturate NaN
    (dict(rotation=True), "always"),  # rotated integer codes too (rotated float codes divide through fp64)
    (dict(rotation=True, element="fp8_e4m3"), ""),
    (dict(apply="reciprocal_multiply"), ""),
])
def test_fast_division_verdicts(side, verdict):
    from kvgen.codegen.render import fast_division

    assert fast_division(_side(**side)) == verdict
