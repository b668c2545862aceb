"""Static scale loading (every checkpoint name form, the SGLang JSON) and `kvgen import-scheme`."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

import kvgen
from kvgen.codegen.spec import ElementType, Granularity
from kvgen.scales import (MissingScalesWarning, ScaleError, checkpoint_name, format_layers, load_scales,
                          scales_for_layer)
from kvgen.scales_cli import import_scheme

F32 = np.float32


def _write(path, tensors):
    save_file({k: np.ascontiguousarray(np.asarray(v, dtype=F32)) for k, v in tensors.items()}, str(path))
    return path


def _load_quiet(path, n, **kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = load_scales(path, n, **kw)
    assert not [x for x in w if issubclass(x.category, MissingScalesWarning)], [str(x.message) for x in w]
    return out


# --- checkpoint names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (1,)])
def test_canonical_per_tensor(tmp_path, shape):
    t = {}
    for i in range(3):
        t[f"model.layers.{i}.self_attn.k_scale"] = np.full(shape, 0.01 * (i + 1))
        t[f"model.layers.{i}.self_attn.v_scale"] = np.full(shape, 0.02 * (i + 1))
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = np.ones((4, 4))  # other tensors are ignored
    s = _load_quiet(_write(tmp_path / "m.safetensors", t), 3)
    for i in range(3):
        k, v = s[i]
        assert isinstance(k, float) and isinstance(v, float)
        assert k == pytest.approx(0.01 * (i + 1)) and v == pytest.approx(0.02 * (i + 1))


def test_per_head_shape(tmp_path):
    h = 4
    kh = np.arange(1, h + 1, dtype=F32).reshape(h, 1, 1) * 0.01
    t = {"model.layers.0.self_attn.k_scale": kh, "model.layers.0.self_attn.v_scale": kh * 2}
    s = _load_quiet(_write(tmp_path / "m.safetensors", t), 1, num_kv_heads=h)
    k, v = s[0]
    assert k.shape == (h,) and k.dtype == F32
    np.testing.assert_allclose(k, kh.reshape(-1))
    np.testing.assert_allclose(v, 2 * kh.reshape(-1))
    # the per-head scales go straight into a per-head format's cache
    fmt = kvgen.load("fp8_e4m3_per_head")
    fmt.allocate(2, 16, h, 64, **scales_for_layer(s, 0))


def test_per_head_wrong_head_count(tmp_path):
    t = {"model.layers.0.self_attn.k_scale": np.ones((4, 1, 1)), "model.layers.0.self_attn.v_scale": np.ones((4, 1, 1))}
    with pytest.raises(ScaleError, match=r"m\.safetensors: model\.layers\.0\.self_attn\.k_scale: 4 per-head"):
        load_scales(_write(tmp_path / "m.safetensors", t), 1, num_kv_heads=8)


@pytest.mark.parametrize("kname,vname", [
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),  # legacy
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # ModelOpt
])
def test_other_name_forms(tmp_path, kname, vname):
    t = {}
    for i in range(2):
        t[f"model.layers.{i}.{kname}"] = [0.5 + i]
        t[f"model.layers.{i}.{vname}"] = [0.25 + i]
    s = _load_quiet(_write(tmp_path / "m.safetensors", t), 2)
    assert s == {0: (0.5, 0.25), 1: (1.5, 1.25)}


def test_deprecated_kv_scale_used_for_both(tmp_path):
    t = {f"model.layers.{i}.self_attn.kv_scale": np.float32(0.125 * (i + 1)) for i in range(2)}
    s = _load_quiet(_write(tmp_path / "m.safetensors", t), 2)
    assert s == {0: (0.125, 0.125), 1: (0.25, 0.25)}


def test_canonical_wins_over_deprecated(tmp_path):
    t = {"model.layers.0.self_attn.kv_scale": [9.0], "model.layers.0.self_attn.k_scale": [0.5],
         "model.layers.0.self_attn.v_scale": [0.75]}
    assert _load_quiet(_write(tmp_path / "m.safetensors", t), 1) == {0: (0.5, 0.75)}


def test_other_prefix_and_bf16(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_pt

    save_pt({"model.language_model.layers.0.self_attn.k_scale": torch.tensor([0.5], dtype=torch.bfloat16),
             "model.language_model.layers.0.self_attn.v_scale": torch.tensor(0.25, dtype=torch.bfloat16)},
            str(tmp_path / "m.safetensors"))
    assert _load_quiet(tmp_path / "m.safetensors", 1) == {0: (0.5, 0.25)}


def test_directory_of_shards(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    _write(d / "model-00001-of-00002.safetensors",
           {"model.layers.0.self_attn.k_scale": [0.1], "model.layers.0.self_attn.v_scale": [0.2]})
    _write(d / "model-00002-of-00002.safetensors",
           {"model.layers.1.self_attn.k_scale": [0.3], "model.layers.1.self_attn.v_scale": [0.4]})
    s = _load_quiet(d, 2)
    assert s[0] == pytest.approx((0.1, 0.2)) and s[1] == pytest.approx((0.3, 0.4))


# --- missing layers ---------------------------------------------------------------------------------------------


def test_missing_layers_one_warning(tmp_path):
    t = {}
    for i in (4, 5, 6, 8, 9):
        t[f"model.layers.{i}.self_attn.k_scale"] = [0.5]
        t[f"model.layers.{i}.self_attn.v_scale"] = [0.5]
    t["model.layers.12.self_attn.k_scale"] = [0.5]  # beyond num_layers (e.g. an MTP layer): ignored
    path = _write(tmp_path / "m.safetensors", t)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = load_scales(path, 10)
    mine = [x for x in w if issubclass(x.category, MissingScalesWarning)]
    assert len(mine) == 1, [str(x.message) for x in w]
    msg = str(mine[0].message)
    assert "layers 0-3, 7" in msg and "1.0" in msg
    assert s[0] == (1.0, 1.0) and s[7] == (1.0, 1.0) and s[4] == (0.5, 0.5)
    assert sorted(s) == list(range(10))


def test_missing_one_side(tmp_path):
    t = {"model.layers.0.self_attn.k_scale": [0.5], "model.layers.0.self_attn.v_scale": [0.5],
         "model.layers.1.self_attn.k_scale": [0.5]}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = load_scales(_write(tmp_path / "m.safetensors", t), 2)
    mine = [str(x.message) for x in w if issubclass(x.category, MissingScalesWarning)]
    assert len(mine) == 1 and "no v_scale for layer 1" in mine[0]
    assert s[1] == (0.5, 1.0)


def test_format_layers():
    assert format_layers([7, 0, 1, 2, 3]) == "0-3, 7"
    assert format_layers([5]) == "5"
    assert format_layers([1, 3, 4, 10, 11, 12]) == "1, 3-4, 10-12"


# --- bad values -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,match", [
    ([0.0], "must be > 0"),
    ([-1.0], "must be > 0"),
    ([np.nan], "not finite"),
    ([np.inf], "not finite"),
    (np.ones((2, 3)), "shape"),
    (np.ones((4, 2, 1)), "shape"),
    (np.ones((0,)), "empty"),
])
def test_bad_values(tmp_path, value, match):
    t = {"model.layers.0.self_attn.k_scale": [0.5], "model.layers.0.self_attn.v_scale": value}
    with pytest.raises(ScaleError, match=match) as e:
        load_scales(_write(tmp_path / "bad.safetensors", t), 1)
    assert "bad.safetensors" in str(e.value) and "model.layers.0.self_attn.v_scale" in str(e.value)
    assert isinstance(e.value, kvgen.KvgenError)


def test_missing_file(tmp_path):
    with pytest.raises(ScaleError, match="no such file"):
        load_scales(tmp_path / "nope.safetensors", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScaleError, match="no \\*.safetensors"):
        load_scales(tmp_path / "empty", 1)


# --- SGLang JSON ------------------------------------------------------------------------------------------------


def _json(path, data):
    path.write_text(json.dumps(data))
    return path


def test_json_tp_ranks(tmp_path):
    data = {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {"0": 0.5, "1": 0.25}, "1": {"0": 2.0, "1": 4}}}}
    p = _json(tmp_path / "kv.json", data)
    assert _load_quiet(p, 2) == {0: (0.5, 0.5), 1: (0.25, 0.25)}
    assert _load_quiet(p, 2, tp_rank=1) == {0: (2.0, 2.0), 1: (4.0, 4.0)}
    with pytest.raises(ScaleError, match="no entry for tp rank 2"):
        load_scales(p, 2, tp_rank=2)


def test_json_missing_layers_warns_once(tmp_path):
    p = _json(tmp_path / "kv.json", {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"2": 0.5}}}})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = load_scales(p, 4)
    mine = [str(x.message) for x in w if issubclass(x.category, MissingScalesWarning)]
    assert len(mine) == 1 and "layers 0-1, 3" in mine[0]
    assert s[2] == (0.5, 0.5) and s[3] == (1.0, 1.0)


@pytest.mark.parametrize("data,match", [
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": -1.0}}}}, r"scaling_factor\.0\.0: .*> 0"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": "x"}}}}, r"scaling_factor\.0\.0: not a"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"a": 1.0}}}}, "not an integer"),
    ({"kv_cache": {"dtype": "float8_e4m3fn"}}, "scaling_factor"),
    ({"other": 1}, "kv_cache"),
])
def test_json_errors(tmp_path, data, match):
    with pytest.raises(ScaleError, match=match) as e:
        load_scales(_json(tmp_path / "kv.json", data), 1)
    assert "kv.json" in str(e.value)


def test_json_infinity(tmp_path):
    p = tmp_path / "kv.json"
    p.write_text('{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": Infinity}}}}')
    with pytest.raises(ScaleError, match="not finite"):
        load_scales(p, 1)


def test_checkpoint_name():
    assert checkpoint_name(3, "k") == "model.layers.3.self_attn.k_scale"
    assert checkpoint_name(0, "v") == "model.layers.0.self_attn.v_scale"


# --- import-scheme ----------------------------------------------------------------------------------------------


def _config(tmp_path, scheme, name="config.json"):
    cfg = {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 8, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
        "kv_cache_scheme": scheme}}
    return _json(tmp_path / name, cfg)


SCHEMES = [
    # llm-compressor FP8 KV cache (per tensor)
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True, "group_size": None,
      "observer": "minmax", "actorder": None, "block_structure": None},
     ElementType.fp8_e4m3, Granularity.per_tensor, None, False),
    # per attention head
    ({"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True,
      "observer": "minmax"},
     ElementType.fp8_e4m3, Granularity.per_head, None, False),
    # dynamic fp8 per token
    ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True},
     ElementType.fp8_e4m3, Granularity.per_token_head, None, False),
    # dynamic int8 per token, symmetric and asymmetric
    ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True},
     ElementType.int8, Granularity.per_token_head, None, False),
    ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": False, "zp_dtype": "int8"},
     ElementType.uint8, Granularity.per_token_head, None, True),
    # dynamic int4 per group of 32, asymmetric; symmetric per group of 64 with fp16 scales
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "dynamic": True, "symmetric": False},
     ElementType.uint4, Granularity.per_block, 32, True),
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "dynamic": True, "symmetric": True,
      "scale_dtype": "float16"},
     ElementType.int4, Granularity.per_block, 64, False),
    # NVFP4
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local",
      "symmetric": True, "scale_dtype": "float8_e4m3fn"},
     ElementType.fp4_e2m1, Granularity.per_block, 16, False),
]


@pytest.mark.parametrize("scheme,element,gran,block,zp", SCHEMES,
                         ids=[f"{s[1].value}-{s[2].value}{s[3] or ''}" for s in SCHEMES])
def test_import_scheme(tmp_path, scheme, element, gran, block, zp):
    cfg = _config(tmp_path, scheme)
    out = tmp_path / "spec.yaml"
    r = CliRunner().invoke(import_scheme, [str(cfg), "-o", str(out), "--name", "imported_kv"])
    assert r.exit_code == 0, (r.output, r.exception)
    text = out.read_text()
    assert text.startswith("# Imported by `kvgen import-scheme` from") and "config.json" in text.splitlines()[0]
    spec = kvgen.load_spec(out)  # validates, and is buildable
    assert spec.name == "imported_kv"
    for side in (spec.key, spec.value):
        assert side.element == element
        assert side.scale.granularity == gran
        assert side.scale.block == block
        assert (side.zero_point is not None) == zp


def test_import_scheme_stdout_and_default_name(tmp_path):
    cfg = _config(tmp_path, SCHEMES[0][0])
    r = CliRunner().invoke(import_scheme, [str(cfg)])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "name: ct_fp8_e4m3_per_tensor" in r.stdout
    from kvgen.codegen.loader import load_spec_text

    assert load_spec_text(r.stdout).key.scale.granularity == Granularity.per_tensor  # stdout: the spec alone
    # llm-compressor's fp8 per-tensor scheme is the shipped fp8_e4m3's bytes: said on stderr
    assert "note: the scheme's bytes are those of the shipped format fp8_e4m3" in r.stderr


def test_import_scheme_names_no_shipped_format_where_none_has_its_bytes(tmp_path):
    scheme = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "dynamic": True,
              "symmetric": True, "scale_dtype": "float16"}
    r = CliRunner().invoke(import_scheme, [str(_config(tmp_path, scheme))])
    assert r.exit_code == 0 and "note:" not in r.stderr


@pytest.mark.parametrize("scheme,field", [
    ({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": False}, "symmetric"),
    ({"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}, "strategy"),
    ({"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32, "dynamic": False}, "dynamic"),
    ({"num_bits": 8, "type": "int", "strategy": "group", "group_size": 24, "dynamic": True}, "group_size"),
    ({"num_bits": 6, "type": "int", "strategy": "token", "dynamic": True}, "num_bits"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}, "dynamic"),
    ({"num_bits": 8, "type": "mx", "strategy": "tensor"}, "type"),
    ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": False, "zp_dtype": "float16"},
     "zp_dtype"),
])
def test_import_scheme_unsupported(tmp_path, scheme, field):
    cfg = _config(tmp_path, scheme)
    r = CliRunner().invoke(import_scheme, [str(cfg)])
    assert isinstance(r.exception, kvgen.KvgenError), (r.output, r.exception)
    msg = str(r.exception)
    assert f"quantization_config.kv_cache_scheme.{field}:" in msg and "config.json" in msg


def test_import_scheme_no_kv_scheme(tmp_path):
    cfg = _config(tmp_path, None)
    r = CliRunner().invoke(import_scheme, [str(cfg)])
    assert isinstance(r.exception, kvgen.KvgenError) and "not quantized" in str(r.exception)
    p = _json(tmp_path / "plain.json", {"architectures": ["LlamaForCausalLM"]})
    r = CliRunner().invoke(import_scheme, [str(p)])
    assert isinstance(r.exception, kvgen.KvgenError) and "no quantization_config.kv_cache_scheme" in str(r.exception)


def test_import_scheme_help():
    r = CliRunner().invoke(import_scheme, ["--help"])
    assert r.exit_code == 0 and "Example:" in r.output


def test_sub_models_with_layers_of_their_own_are_refused_unless_a_prefix_picks_one(tmp_path):
    """An audio tower's layer 0 and the language model's layer 0 both carry k_scale: the loader took whichever sorted
    first, silently. Different values under one layer index are now an error naming both tensors; prefix= picks."""
    t = {"model.audio_tower.layers.0.self_attn.k_scale": np.array([5.0], np.float32),
         "model.audio_tower.layers.0.self_attn.v_scale": np.array([5.0], np.float32),
         "model.language_model.layers.0.self_attn.k_scale": np.array([0.1], np.float32),
         "model.language_model.layers.0.self_attn.v_scale": np.array([0.2], np.float32)}
    path = _write(tmp_path / "m.safetensors", t)
    with pytest.raises(ScaleError, match=r"layer 0's k scale is given twice, differently: .*audio_tower.*language_model"
                                         r".*prefix="):
        load_scales(path, 1)
    got = load_scales(path, 1, prefix="model.language_model.")
    assert got[0][0] == pytest.approx(0.1) and got[0][1] == pytest.approx(0.2)
    assert load_scales(path, 1, prefix="model.audio_tower.") == {0: (5.0, 5.0)}


def test_an_asymmetric_schemes_zero_points_are_refused(tmp_path):
    t = {"model.layers.0.self_attn.k_scale": np.array([0.5], np.float32),
         "model.layers.0.self_attn.v_scale": np.array([0.5], np.float32),
         "model.layers.0.self_attn.k_zero_point": np.array([3], np.int8)}
    with pytest.raises(ScaleError, match=r"k_zero_point: a zero point: the checkpoint's KV scheme is asymmetric"):
        load_scales(_write(tmp_path / "m.safetensors", t), 1)


def test_per_head_scales_of_the_whole_model_give_each_tp_rank_its_heads(tmp_path):
    """A checkpoint holds all 8 KV heads' scales; at tensor parallelism 2 each rank has 4 heads and takes its 4."""
    heads = np.arange(1, 9, dtype=np.float32).reshape(8, 1, 1)
    t = {"model.layers.0.self_attn.k_scale": heads, "model.layers.0.self_attn.v_scale": heads * 2}
    path = _write(tmp_path / "m.safetensors", t)
    for rank in (0, 1):
        k, v = load_scales(path, 1, tp_rank=rank, num_kv_heads=4)[0]
        np.testing.assert_array_equal(k, heads.reshape(-1)[rank * 4:rank * 4 + 4])
        np.testing.assert_array_equal(v, 2 * heads.reshape(-1)[rank * 4:rank * 4 + 4])
    with pytest.raises(ScaleError, match=r"8 per-head scales, but the model has 4 KV heads \(and tp_rank 2 is past"):
        load_scales(path, 1, tp_rank=2, num_kv_heads=4)
    with pytest.raises(ScaleError, match=r"8 per-head scales, but the model has 3 KV heads"):
        load_scales(path, 1, num_kv_heads=3)


def test_skip_layers_are_not_named_missing(tmp_path):
    t = {"model.layers.0.self_attn.k_scale": np.array([0.5], np.float32),
         "model.layers.0.self_attn.v_scale": np.array([0.5], np.float32)}
    path = _write(tmp_path / "m.safetensors", t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_scales(path, 2, skip_layers=[1]) == {0: (0.5, 0.5), 1: (1.0, 1.0)}
    with pytest.warns(MissingScalesWarning, match="layer 1"):
        load_scales(path, 2)


def test_sub_models_are_compared_whatever_name_form_each_uses(tmp_path):
    """A vision tower's self_attn.k_scale and the language model's ModelOpt k_proj.k_scale: the preferred form won
    silently; different values under one layer index are refused whatever the forms."""
    t = {"model.vision_tower.layers.0.self_attn.k_scale": np.array([9.0], np.float32),
         "model.vision_tower.layers.0.self_attn.v_scale": np.array([9.0], np.float32),
         "model.language_model.layers.0.self_attn.k_proj.k_scale": np.array([0.1], np.float32),
         "model.language_model.layers.0.self_attn.v_proj.v_scale": np.array([0.1], np.float32)}
    path = _write(tmp_path / "m.safetensors", t)
    with pytest.raises(ScaleError, match="given twice, differently"):
        load_scales(path, 1)
    assert load_scales(path, 1, prefix="model.language_model.")[0][0] == pytest.approx(0.1)


def test_zero_points_of_zero_are_a_symmetric_scheme(tmp_path):
    """Older compressed-tensors exports store zero points of 0 for symmetric schemes: accepted."""
    t = {"model.layers.0.self_attn.k_scale": np.array([0.5], np.float32),
         "model.layers.0.self_attn.v_scale": np.array([0.5], np.float32),
         "model.layers.0.self_attn.k_zero_point": np.array([0], np.int8),
         "model.layers.0.self_attn.v_zero_point": np.array([0], np.int8)}
    assert load_scales(_write(tmp_path / "m.safetensors", t), 1) == {0: (0.5, 0.5)}


def test_replicated_heads_go_to_the_ranks_that_hold_them(tmp_path):
    """2 KV heads at tensor parallelism 4: vLLM gives ranks 0-1 head 0 and ranks 2-3 head 1. Without tp_size rank 1
    took head 1 (right only at tp 2) and ranks 2-3 were refused; with it each rank gets its head."""
    heads = np.array([1.0, 2.0], np.float32).reshape(2, 1, 1)
    path = _write(tmp_path / "m.safetensors", {"model.layers.0.self_attn.k_scale": heads,
                                               "model.layers.0.self_attn.v_scale": heads * 4})
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        k, v = load_scales(path, 1, tp_rank=rank, num_kv_heads=1, tp_size=4)[0]
        assert (k.tolist(), v.tolist()) == ([heads[head, 0, 0]], [4 * heads[head, 0, 0]]), rank
    k, _ = load_scales(path, 1, tp_rank=1, num_kv_heads=1, tp_size=2)[0]
    assert k.tolist() == [2.0]  # no replication at tp 2: rank 1 holds head 1
    with pytest.raises(ScaleError, match="pass tp_size="):
        load_scales(path, 1, tp_rank=2, num_kv_heads=1)
    with pytest.raises(ScaleError, match="tp_size 3 is not a multiple of the checkpoint's 2 KV heads"):
        load_scales(path, 1, tp_rank=0, num_kv_heads=1, tp_size=3)
    for kwargs, name in ((dict(tp_rank="1"), "tp_rank"), (dict(num_kv_heads=0), "num_kv_heads"),
                         (dict(tp_rank=4, tp_size=4, num_kv_heads=1), "tp_rank"), (dict(tp_size=4), "tp_size")):
        with pytest.raises(ValueError, match=f"^{name}: "):
            load_scales(path, 1, **kwargs)


def test_a_file_without_any_kv_scale_is_an_error(tmp_path):
    """Plain weights, or scales under names kvgen does not read, loaded as 1.0 everywhere with only a warning."""
    path = _write(tmp_path / "w.safetensors", {"model.layers.0.mlp.down_proj.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(ScaleError, match="no KV-cache scale found"):
        load_scales(path, 2)
    with pytest.raises(ScaleError, match="no KV-cache scale found under prefix 'model.text.'"):
        load_scales(_write(tmp_path / "s.safetensors", {"model.layers.0.self_attn.k_scale": np.float32(0.5)}), 1,
                    prefix="model.text.")


def test_vllms_own_parameter_names_are_read(tmp_path):
    t = {"model.layers.0.self_attn.attn.k_scale": np.array(0.25, np.float32),
         "model.layers.0.self_attn.attn.v_scale": np.array(0.5, np.float32)}
    assert load_scales(_write(tmp_path / "v.safetensors", t), 1) == {0: (0.25, 0.5)}


def test_one_tensor_with_two_values_in_two_shards_is_an_error(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    _write(d / "a.safetensors", {"model.layers.0.self_attn.k_scale": np.array(0.1, np.float32),
                                 "model.layers.0.self_attn.v_scale": np.array(0.2, np.float32)})
    _write(d / "b.safetensors", {"model.layers.0.self_attn.k_scale": np.array(0.9, np.float32)})
    with pytest.raises(ScaleError, match="self_attn.k_scale is in two files with different values"):
        load_scales(d, 1)


@pytest.mark.parametrize("value,words", [(np.array([1e39]), "overflows float32"), (np.array([1e-50]), "rounds to 0"),
                                         (np.array([True]), "a boolean")])
def test_per_tensor_scales_must_fit_float32(tmp_path, value, words):
    """A float64 checkpoint's 1e39 or 1e-50 (and a bool tensor, as 1.0) passed here and failed in allocate naming no
    file; the cache keeps fp32 scales."""
    t = {"model.layers.0.self_attn.k_scale": value, "model.layers.0.self_attn.v_scale": np.array([1.0], np.float32)}
    save_file(t, str(tmp_path / "m.safetensors"))
    with pytest.raises(ScaleError, match=words):
        load_scales(tmp_path / "m.safetensors", 1)


def test_import_scheme_names_a_bad_name_option(tmp_path):
    """--name 'Bad Name!' was reported as the config's fault (exit 1); it is the option's (exit 2)."""
    from kvgen.cli import main as cli_main

    cfg = _config(tmp_path, SCHEMES[0][0])
    r = CliRunner().invoke(cli_main, ["import-scheme", str(cfg), "--name", "Bad Name!"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --name: 'Bad Name!' is not a valid format name"), r.stderr
