"""The .pyi stub of the native module must not drift from the module itself."""

import ast
from pathlib import Path

import flash_nif
from flash_nif import _native

STUB = Path(flash_nif.__file__).with_name("_native.pyi")


def test_stub_defines_exactly_the_native_functions():
    tree = ast.parse(STUB.read_text())
    stubbed = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    native = {n for n in dir(_native) if not n.startswith("_") and callable(getattr(_native, n))}
    assert stubbed == native


def test_package_is_typed():
    assert Path(flash_nif.__file__).with_name("py.typed").exists()
