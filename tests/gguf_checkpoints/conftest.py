import pytest

pytest.importorskip("gguf")
