"""Package list for setuptools: the repo root is the `kvgen` package; every sub-package (generated formats too)
is found here, so adding a spec never means editing pyproject.toml."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

SUBPACKAGES = find_packages(".", include=["codegen*", "runtime*", "reference*", "generated*"])
# folders of data only (Jinja templates, the shipped specs): packages without an __init__.py, named so that setuptools
# installs their files (package-data in pyproject.toml)
DATA_PACKAGES = ["codegen.templates", "codegen.templates.codecs", "specs"]


class BuildPy(build_py):
    """The root package is the repo root: leave this file out of it (importing kvgen.setup would run setuptools)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "kvgen" and m[1] == "setup")]


setup(packages=["kvgen"] + [f"kvgen.{p}" for p in SUBPACKAGES + DATA_PACKAGES], cmdclass={"build_py": BuildPy})
