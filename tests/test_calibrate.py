"""`kvgen calibrate`: static scales from sample activations, saved in the checkpoint / SGLang forms."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

import kvgen
from kvgen import reference as R
from kvgen.calibrate import CalibrationError, calibrate, load_samples, save_scales
from kvgen.scales import MissingScalesWarning, load_scales, scales_for_layer
from kvgen.scales_cli import calibrate as calibrate_cmd

FP8 = kvgen.load_spec(kvgen.__path__[0] + "/specs/fp8_e4m3.yaml")
FP8_HEAD = kvgen.load_spec(kvgen.__path__[0] + "/specs/fp8_e4m3_per_head.yaml")


def _uniform(rng, a, shape=(512, 4, 64)):
    return rng.uniform(-a, a, shape).astype(np.float32)


def _mse(spec_side, x, scale):
    enc = R.encode_side(spec_side, x, scale)
    return float(np.mean((R.decode_side(spec_side, enc.data, static_scale=scale) - x) ** 2))


def test_absmax_recovers_known_range():
    rng = np.random.default_rng(0)
    samples = {i: (_uniform(rng, 2.0 + i), _uniform(rng, 0.5 * (i + 1))) for i in range(3)}
    s = calibrate(samples, FP8, observer="absmax")
    for i in range(3):
        k, v = s[i]
        assert isinstance(k, float)
        assert k == pytest.approx((2.0 + i) / 448, rel=0.01)
        assert v == pytest.approx(0.5 * (i + 1) / 448, rel=0.01)


def test_qmax_per_element():
    rng = np.random.default_rng(1)
    x = _uniform(rng, 3.0)
    e5m2 = kvgen.load_spec(kvgen.__path__[0] + "/specs/fp8_e5m2.yaml")
    (k, _), = calibrate({0: (x, x)}, e5m2).values()
    assert k == pytest.approx(3.0 / 57344, rel=0.01)


def test_per_head_recovers_head_ranges():
    rng = np.random.default_rng(2)
    ranges = np.array([0.5, 1.0, 4.0, 16.0], dtype=np.float32)
    k = rng.uniform(-1, 1, (1024, 4, 64)).astype(np.float32) * ranges[None, :, None]
    s = calibrate({0: (k, k * 2)}, FP8_HEAD, observer="absmax")
    ks, vs = s[0]
    assert ks.shape == (4,) and ks.dtype == np.float32
    np.testing.assert_allclose(ks, ranges / 448, rtol=0.01)
    np.testing.assert_allclose(vs, 2 * ranges / 448, rtol=0.01)
    # explicit per-tensor for a per-head format: one value
    (kt, _), = calibrate({0: (k, k)}, FP8_HEAD, per_head=False).values()
    assert isinstance(kt, float) and kt == pytest.approx(16.0 / 448, rel=0.01)


def test_per_head_needs_per_head_format():
    x = np.ones((4, 2, 16), np.float32)
    with pytest.raises(CalibrationError, match="per_tensor"):
        calibrate({0: (x, x)}, FP8, per_head=True)


def test_dynamic_format_refused():
    x = np.ones((4, 2, 16), np.float32)
    with pytest.raises(CalibrationError, match="computes its scales on write"):
        calibrate({0: (x, x)}, kvgen.load("int8_per_token_head"))


def test_percentile_clips_outliers():
    rng = np.random.default_rng(3)
    x = _uniform(rng, 1.0, (2048, 2, 64))
    x[0, 0, 0] = 100.0  # one outlier
    (ka, _), = calibrate({0: (x, x)}, FP8, observer="absmax").values()
    (kp, _), = calibrate({0: (x, x)}, FP8, observer="percentile", percentile=99.9).values()
    assert ka == pytest.approx(100.0 / 448, rel=1e-6)
    assert kp == pytest.approx(0.999 / 448, rel=0.01)


def test_mse_beats_absmax_on_heavy_tails():
    rng = np.random.default_rng(4)
    x = (rng.standard_t(2, (1024, 4, 64)) * 0.1).astype(np.float32)  # heavy tails
    (ka, _), = calibrate({0: (x, x)}, FP8, observer="absmax").values()
    (km, _), = calibrate({0: (x, x)}, FP8, observer="mse").values()
    assert km <= ka
    assert _mse(FP8.key, x, km) < _mse(FP8.key, x, ka)


def test_mse_per_head():
    rng = np.random.default_rng(5)
    x = (rng.standard_t(2, (512, 2, 32)) * np.array([0.1, 1.0])[None, :, None]).astype(np.float32)
    s = calibrate({0: (x, x)}, FP8_HEAD, observer="mse")[0][0]
    amax = np.abs(x).max(axis=(0, 2)) / 448
    assert s.shape == (2,) and np.all(s <= amax * (1 + 1e-6))
    assert _mse(FP8_HEAD.key, x, s) <= _mse(FP8_HEAD.key, x, amax.astype(np.float32))


def test_zero_layer_gets_one():
    z = np.zeros((8, 2, 16), np.float32)
    assert calibrate({0: (z, z)}, FP8)[0] == (1.0, 1.0)


def test_round_trip_safetensors(tmp_path):
    rng = np.random.default_rng(6)
    samples = {i: (_uniform(rng, 1.0 + i, (64, 4, 64)), _uniform(rng, 2.0 + i, (64, 4, 64))) for i in range(4)}
    for spec, name in ((FP8, "fp8_e4m3"), (FP8_HEAD, "fp8_e4m3_per_head")):
        s = calibrate(samples, spec, observer="absmax")
        out = tmp_path / f"{name}.safetensors"
        save_scales(s, out)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            back = load_scales(out, 4, num_kv_heads=4)
        assert not [x for x in w if issubclass(x.category, MissingScalesWarning)]
        fmt = kvgen.load(name)
        for i in range(4):
            for a, b in zip(s[i], back[i]):
                np.testing.assert_array_equal(np.float32(a), np.float32(b))
            cache = fmt.allocate(2, 16, 4, 64, **scales_for_layer(back, i))
            assert cache is not None


def test_round_trip_json(tmp_path):
    rng = np.random.default_rng(7)
    samples = {i: (_uniform(rng, 1.0, (64, 2, 32)), _uniform(rng, 3.0, (64, 2, 32))) for i in range(2)}
    s = calibrate(samples, FP8)
    out = tmp_path / "kv.json"
    save_scales(s, out, tp_size=2)
    data = json.loads(out.read_text())
    assert data["kv_cache"]["dtype"] == "float8_e4m3fn"
    assert set(data["kv_cache"]["scaling_factor"]) == {"0", "1"}
    back = load_scales(out, 2, tp_rank=1)
    for i in range(2):
        assert back[i][0] == back[i][1] == pytest.approx(max(s[i]))  # one value for K and V: the larger
    with pytest.raises(kvgen.KvgenError, match="per-head"):
        save_scales(calibrate(samples, FP8_HEAD), tmp_path / "h.json")


def test_load_samples_names(tmp_path):
    rng = np.random.default_rng(8)
    a = {"layers.0.k": _uniform(rng, 1, (8, 2, 16)), "layers.0.v": _uniform(rng, 1, (8, 2, 16)),
         "model.layers.1.self_attn.key": _uniform(rng, 1, (2, 8, 2, 16)),
         "model.layers.1.self_attn.value": _uniform(rng, 1, (16, 2, 16)), "unrelated": np.zeros(3, np.float32)}
    np.savez(tmp_path / "s.npz", **a)
    save_file(a, str(tmp_path / "s.safetensors"))
    for p in (tmp_path / "s.npz", tmp_path / "s.safetensors"):
        s = load_samples(p)
        assert sorted(s) == [0, 1]
        assert s[1][0].shape == (16, 2, 16)
    np.savez(tmp_path / "bad.npz", **{"layers.0.k": np.zeros((4, 2, 8), np.float32)})
    with pytest.raises(CalibrationError, match="no V samples"):
        load_samples(tmp_path / "bad.npz")
    np.savez(tmp_path / "none.npz", x=np.zeros(3))
    with pytest.raises(CalibrationError, match="no K/V samples"):
        load_samples(tmp_path / "none.npz")


def test_cli(tmp_path):
    rng = np.random.default_rng(9)
    np.savez(tmp_path / "acts.npz", **{f"layers.{i}.{s}": _uniform(rng, 2.0, (128, 2, 32)) for i in range(3)
                                       for s in "kv"})
    for observer, out in (("absmax", "kv.safetensors"), ("mse", "kv.json"), ("percentile", "p.safetensors")):
        r = CliRunner().invoke(calibrate_cmd, [str(tmp_path / "acts.npz"), "--format", "fp8_e4m3",
                                               "--observer", observer, "-o", str(tmp_path / out)])
        assert r.exit_code == 0, (r.output, r.exception)
        s = load_scales(tmp_path / out, 3)
        assert all(0 < s[i][0] <= 2.0 / 448 * 1.0001 for i in range(3))
    r = CliRunner().invoke(calibrate_cmd, [str(tmp_path / "acts.npz"), "--format", "fp8_e4m3_per_head",
                                           "-o", str(tmp_path / "h.json")])
    assert isinstance(r.exception, kvgen.KvgenError) and "per-head" in str(r.exception)
    r = CliRunner().invoke(calibrate_cmd, ["--help"])
    assert r.exit_code == 0 and "Example:" in r.output


def test_cli_output_suffix_is_a_usage_error(tmp_path):
    # the output's suffix is checked before any sample is read; through kvgen's group: one line, exit 2
    from kvgen.cli import main as cli_main

    r = CliRunner().invoke(cli_main, ["calibrate", str(tmp_path / "missing.npz"), "--format", "fp8_e4m3",
                                      "-o", str(tmp_path / "kv.txt")])
    assert r.exit_code == 2, r.output
    assert "--out" in r.stderr and "kv.txt" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_per_head_for_a_per_tensor_format_is_a_usage_error(tmp_path):
    """--per-head with fp8_e4m3 (one scale per layer) exited 1 after reading the samples; an option the format
    cannot take exits 2 before any sample is read."""
    from kvgen.cli import main as cli_main

    r = CliRunner().invoke(cli_main, ["calibrate", str(tmp_path / "missing.npz"), "--format", "fp8_e4m3",
                                      "--per-head", "-o", str(tmp_path / "kv.safetensors")])
    assert r.exit_code == 2 and "--per-head" in r.stderr and "per_tensor" in r.stderr, r.stderr


def test_a_global_scale_format_is_told_what_its_scales_are():
    """nvfp4 was refused as computing its scales on write, though its k_scale / v_scale are static global scales."""
    with pytest.raises(CalibrationError, match="per-layer global scale over the block scales"):
        calibrate({0: (np.ones((4, 1, 16), np.float32),) * 2}, "nvfp4")


def test_cli_tp_size_goes_with_json_output(tmp_path):
    from kvgen.cli import main as cli_main

    r = CliRunner().invoke(cli_main, ["calibrate", str(tmp_path / "missing.npz"), "--format", "fp8_e4m3",
                                      "--tp-size", "2", "-o", str(tmp_path / "kv.safetensors")])
    assert r.exit_code == 2 and r.stderr.startswith("error: --tp-size:"), r.stderr


def test_cli_names_the_samples_file_of_a_bad_layer(tmp_path):
    from kvgen.cli import main as cli_main

    rng = np.random.default_rng(3)
    np.savez(tmp_path / "acts.npz", **{"layers.0.k": _uniform(rng, 1.0, (8, 2, 16)),
                                       "layers.0.v": _uniform(rng, 1.0, (8, 2, 16)),
                                       "layers.1.k": _uniform(rng, 1.0, (8, 3, 16)),
                                       "layers.1.v": _uniform(rng, 1.0, (8, 3, 16))})
    r = CliRunner().invoke(cli_main, ["calibrate", str(tmp_path / "acts.npz"), "--format", "fp8_e4m3",
                                      "-o", str(tmp_path / "kv.safetensors")])
    assert r.exit_code == 1 and f"error: {tmp_path / 'acts.npz'}: layer 1: 3 K / 3 V heads, expected 2" in r.stderr, \
        r.stderr
