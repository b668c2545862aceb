"""kvgen's version: recorded in every generated package and checked by the runtime."""

KVGEN_VERSION = "0.1.0"
