"""The real model these tests run: SmolLM2-135M-Instruct, pulled by name into the cache
(./scripts/run_tests.sh pulls it first); the tests skip when it cannot be pulled."""

import pytest

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2():
    """(checkpoint directory, the checked GGUF file it was converted from)."""
    pytest.importorskip("gguf")
    from tandem import named_models, pull

    try:
        path = pull.pull(NAME)
    except pull.PullError as e:
        pytest.skip(f"{NAME} cannot be pulled here: {str(e).splitlines()[0]}")
    return path, pull.gguf_path(named_models.MODELS[NAME])
