"""Package list for setuptools: the repo root is the `kvgen` package; every sub-package (generated formats too)
is found here, so adding a spec never means editing pyproject.toml."""

from setuptools import find_packages, setup

SUBPACKAGES = find_packages(".", include=["codegen*", "runtime*", "reference*", "generated*"])
# folders of data only (Jinja templates, the shipped specs): packages without an __init__.py, named so that setuptools
# installs their files (package-data in pyproject.toml)
DATA_PACKAGES = ["codegen.templates", "codegen.templates.codecs", "specs"]
setup(packages=["kvgen"] + [f"kvgen.{p}" for p in SUBPACKAGES + DATA_PACKAGES])
