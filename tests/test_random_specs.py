"""Every spec that validates builds and conforms: random valid specs across the whole format space.

Specs are drawn from kvgen.conformance.format_specs (elements, scale dtypes, granularities, placements, zero
points, rotation, packing, K != V, split or interleaved pages), validated, built through `kvgen.load` of a YAML
file, and checked with the same properties as the shipped formats on a few random cases each.
"""

from __future__ import annotations

import os

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvgen
from kvgen.conformance import cases, format_specs, run_case

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
SPECS = int(os.environ.get("KVGEN_RANDOM_SPECS", "40"))


@settings(max_examples=SPECS, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(spec=format_specs(), data=st.data())
def test_random_spec_builds_and_conforms(spec, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    path = root / "random_spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    before = os.environ.get("KVGEN_CACHE_DIR")
    os.environ["KVGEN_CACHE_DIR"] = str(root / "cache")
    try:
        fmt = kvgen.load(path)  # validation and build: a valid spec never raises here
    finally:
        if before is None:
            del os.environ["KVGEN_CACHE_DIR"]
        else:
            os.environ["KVGEN_CACHE_DIR"] = before
    for _ in range(2):
        case = data.draw(cases(fmt, max_len=30))
        failures = {p: m for p, m in run_case(fmt, case, DEVICE).items() if m}
        assert not failures, (yaml.safe_dump(spec, sort_keys=False), case, failures)
