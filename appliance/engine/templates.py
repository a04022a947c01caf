"""Moved: the shipped chat templates and load_template live in appliance/chat_templates/, which
config reads without importing the engine. This name stays only for tests/web/ (being rewritten
by another change) until it imports load_template from there; then this file goes."""
from ..chat_templates import load_template

__all__ = ["load_template"]
