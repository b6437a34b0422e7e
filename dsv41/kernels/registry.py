"""Tables keyed by kernel name (the Torch backend, the signatures) share one way of filling them."""
from __future__ import annotations


def registrar(table: dict):
    """Decorator factory: ``@register("a", "b")`` files the function under each kernel name."""
    def register(*names):
        def deco(fn):
            for n in names:
                table[n] = fn
            return fn
        return deco
    return register
