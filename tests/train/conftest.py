from tests.train.fixtures import trained_eagle3_head  # noqa: F401  (session fixture, shared)
