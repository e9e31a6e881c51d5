"""Structured output: a grammar (JSON Schema, regex, Lark) constrains what a sequence may say."""

from .grammar import Grammar
from .matcher import Constraint

__all__ = ["Grammar", "Constraint"]
