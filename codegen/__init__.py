"""Spec schema, validation and the code generator (templates -> generated packages)."""
