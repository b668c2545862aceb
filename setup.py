"""Package list for setuptools: the repo root is the `kvgen` package; every sub-package (generated formats too)
is found here, so adding a spec never means editing pyproject.toml."""

from setuptools import find_packages, setup

SUBPACKAGES = find_packages(".", include=["codegen*", "runtime*", "reference*", "generated*"])
setup(packages=["kvgen"] + [f"kvgen.{p}" for p in SUBPACKAGES])
