"""A stand-in for the adaptive policy whose choice is scripted, for tests that need given draft shapes."""

from tandem.speculative.policy import DepthPolicy, DraftShape


class ScriptedChoice(DepthPolicy):
    """The options and bookkeeping of `base`'s kind of policy; each step's shape comes from `script`, which
    sees the keywords the engine passes to `choose` (catch_up_forced, remaining, ...)."""

    def __init__(self, base: DepthPolicy):
        super().__init__(base.num_steps, tree=base.deepest.tree)
        self.turn = 0

    def choose(self, request_ids, padded_batch, **engine_says) -> DraftShape:
        self.turn += 1
        return self.script(**engine_says)

    def script(self, **engine_says) -> DraftShape:
        raise NotImplementedError
