"""The device-only phases of a speculative decode iteration: draft the tree, run the target over it
(verify forward), and extend the draft over the accepted tokens. Each runs eagerly or, on a GPU,
replays a CUDA graph captured per padded batch size (runtime/cuda_graphs.py). Greedy steps go
further: `SpecWorker.decode_iteration` (all phases plus acceptance and the state updates) is one
graph, since nothing in it needs the host.

Graphs need shapes fixed at capture, so in graph mode every decode step uses the widest KV window
(`graph_kv_width`, a request's most pages) instead of the step's own bound; the kernels stop at each
row's length (`kv_lens`), so the wide window costs index memory, not attention time. Padded rows
point at the sink page (one page past the scheduler's pool, in both KV caches) and at the pool's
pad row, so whatever they compute lands where no request looks.
"""

from __future__ import annotations

import logging

import torch

from tandem.layers.sampler import GRAPHED_CONSTRAINED, GRAPHED_GENERAL, GRAPHED_SAMPLING, SamplingFeatures
from tandem.models.llama import StepContext
from tandem.runtime.cuda_graphs import GraphedFunction, GraphInput
from tandem.speculative import plan
from tandem.speculative.policy import DraftShape
from tandem.speculative.tree import DraftTree, ancestor_mask, chain_ancestor_mask

logger = logging.getLogger(__name__)


class SpecPhases:
    def __init__(self, runner, drafter, num_draft_tokens: int):
        self.runner = runner
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.graphs: dict[str, GraphedFunction] = {}
        self.graph_kv_width = 0  # KV window of every graphed step (0: no graphs)
        self.tree_max_depth = 0  # of a graphed draft tree (shapes of verify/extend)
        # Every tree is a chain (top-1 drafting): the verify mask is a constant triangle.
        self.chain = getattr(drafter, "topk", 1) == 1
        # The configured shape: the only one the phase graphs below are captured for.
        self.configured = DraftShape(drafter.num_steps, tree=not self.chain)

    def num_nodes(self, shape: DraftShape) -> int:
        return self.num_draft_tokens if shape.tree else shape.depth + 1

    # ---- the phases, eager ------------------------------------------------------------------
    def verify_forward(self, tokens, parents, depths, seq_lens, node_slots, node_cols, kv_slots, prefix_mask,
                       chain: bool | None = None):
        """The target over each row's tree: returns logits [B, N, V], hidden [B, N, H] and the
        auxiliary states the draft wants, each [B, N, H]."""
        runner = self.runner
        b, n = tokens.shape
        vplan = plan.VerifyPlan(seq_lens, node_slots, node_cols, kv_slots, prefix_mask)
        chain = self.chain if chain is None else chain
        # (Depth 0 never gets here: it is plain decoding's step, speculative/root_step.py.)
        ancestors = chain_ancestor_mask(b, n, tokens.device) if chain else ancestor_mask(parents)
        metadata = plan.verify_metadata(vplan, ancestors)
        positions = (seq_lens[:, None] + depths).reshape(-1)
        ctx = StepContext(runner.backend, metadata, runner.kv_cache.k, runner.kv_cache.v)
        hidden, aux = runner.model(tokens.reshape(-1), positions, ctx, aux_layer_ids=self.drafter.model.aux_layer_ids)
        logits = runner.model.compute_logits(hidden).view(b, n, -1)
        return (logits, hidden.view(b, n, -1), *(a.view(b, n, -1) for a in aux))

    def _draft_tree_fn(self, slots, page_rows):
        tree = self.drafter.draft_tree(slots, page_rows, self.graph_kv_width, self.num_draft_tokens)
        return tree.tokens, tree.parents, tree.depths

    def _catch_up_fn(self, slots, page_rows):
        self.drafter.catch_up(slots, page_rows, self.graph_kv_width, self.runner.sink_slot)
        return ()

    def _extend_fn(self, slots, tokens, features, accept_lens, first_pos, slot_mapping, kv_slots, mask, kv_lens):
        b, q = tokens.shape
        metadata = plan.TorchAttentionMetadata(
            slot_mapping.reshape(-1), torch.arange(b * q, device=tokens.device).view(b, q), None, kv_slots,
            mask[:, None], kv_lens=kv_lens)
        self.drafter.extend(slots, metadata, tokens, features, accept_lens, first_pos)
        return ()

    # ---- what the worker calls ---------------------------------------------------------------
    def graphed(self, batch_size: int) -> bool:
        return bool(self.graphs) and self.graphs["verify"].fits(batch_size)

    def iteration_graph(self, features: SamplingFeatures, shape: DraftShape) -> GraphedFunction | None:
        return self.graphs.get(_iteration_key(features, shape))

    def iteration_graphed(self, batch_size: int, features: SamplingFeatures, shape: DraftShape) -> bool:
        graph = self.iteration_graph(features, shape)
        return graph is not None and graph.fits(batch_size)

    def iteration(self, features: SamplingFeatures, shape: DraftShape, slots, page_rows, coins, use_coins,
                  allowed=None):
        """The whole iteration (SpecWorker.decode_iteration) replayed: (accept_lens, out_tokens), and
        with logprobs (GENERAL) the produced tokens' (chosen [B, Q], top values and ids [B, Q, 20]).
        allowed: [B, V] bool, the root's grammar mask (constrained depth-0 graphs only)."""
        args = (slots, page_rows, coins, use_coins) + ((allowed,) if features.constrained else ())
        return self.graphs[_iteration_key(features, shape)](*args)

    def dormant_graph(self, features: SamplingFeatures) -> GraphedFunction | None:
        return self.graphs.get(_dormant_key(features))

    def dormant_graphed(self, batch_size: int, features: SamplingFeatures) -> bool:
        graph = self.dormant_graph(features)
        return graph is not None and graph.fits(batch_size)

    def dormant(self, features: SamplingFeatures, slots, page_rows):
        """The root step (speculative/root_step.py, without deferred extends) replayed: (out_tokens [B, 1],)
        and with logprobs (GENERAL) the chosen token's [B, 1] and the top values and ids [B, 1, 20]."""
        return self.graphs[_dormant_key(features)](slots, page_rows)

    def split_graphed(self, batch_size: int, features: SamplingFeatures, shape: DraftShape) -> bool:
        """Whether a constrained step that drafts can replay its two half-iteration graphs (the host
        computes the tree's grammar masks between them)."""
        graph = self.graphs.get(_verify_commit_key(features, shape))
        return graph is not None and graph.fits(batch_size)

    def draft_half(self, shape: DraftShape, slots, page_rows) -> DraftTree:
        return self._tree(shape, *self.graphs[f"draft:{shape.name}"](slots, page_rows))

    def _tree(self, shape: DraftShape, tokens, parents, depths) -> DraftTree:
        """A draft graph's output tensors as the DraftTree that shape's drafting returns."""
        return DraftTree(tokens, parents, depths, max_depth=self.tree_max_depth if shape.tree else shape.depth,
                         chain=self.chain or not shape.tree)

    def verify_half(self, features: SamplingFeatures, shape: DraftShape, slots, page_rows, tree: DraftTree, coins,
                    use_coins, allowed):
        """(accept_lens, out_tokens). allowed: [B, N, V] bool, every node's grammar mask."""
        return self.graphs[_verify_commit_key(features, shape)](slots, page_rows, tree.tokens, tree.parents,
                                                                tree.depths, coins, use_coins, allowed)

    def catch_up_graphed(self, rows: int) -> bool:
        graph = self.graphs.get("catch_up")
        return graph is not None and graph.fits(rows)

    def catch_up(self, slots, page_rows, kv_bound: int, window: int | None = None) -> None:
        """The draft over every row's deferred tokens (speculative/catch_up.py); `window`: the batch's
        largest lag (eager steps run that many queries per row, the graph the whole buffer)."""
        if self.catch_up_graphed(slots.shape[0]):
            self.graphs["catch_up"](slots, page_rows)
        else:
            self.drafter.catch_up(slots, page_rows, kv_bound, self.runner.sink_slot, window)

    def draft_tree(self, slots, page_rows, kv_bound: int, shape: DraftShape) -> DraftTree:
        if shape != self.configured:  # a shorter chain of the adaptive policy's
            return self.drafter.draft_tree(slots, page_rows, kv_bound, self.num_nodes(shape), shape.depth)
        if not self.graphed(slots.shape[0]):
            return self.drafter.draft_tree(slots, page_rows, kv_bound, self.num_draft_tokens)
        tokens, parents, depths = self.graphs["draft_tree"](slots, page_rows)
        return DraftTree(tokens, parents, depths, max_depth=self.tree_max_depth, chain=self.chain)

    def verify(self, tree: DraftTree, vplan: plan.VerifyPlan):
        args = (tree.tokens, tree.parents, tree.depths, vplan.seq_lens, vplan.node_slots, vplan.node_cols,
                vplan.kv_slots, vplan.prefix_mask)
        configured = tree.tokens.shape[1] == self.num_draft_tokens and tree.chain == self.chain
        if configured and self.graphed(tree.tokens.shape[0]):
            out = self.graphs["verify"](*args)
        else:
            out = self.verify_forward(*args, chain=tree.chain)
        logits, hidden, *aux = out
        return logits, hidden.reshape(-1, hidden.shape[-1]), [a.reshape(-1, a.shape[-1]) for a in aux]

    def extend(self, slots, metadata, tokens, features, accept_lens, first_pos) -> None:
        b, q = tokens.shape
        if q != self.tree_max_depth + 1 or not self.graphed(b):
            self.drafter.extend(slots, metadata, tokens, features, accept_lens, first_pos)
            return
        args = [slots, tokens, features, accept_lens, first_pos, metadata.slot_mapping.view(b, q),
                metadata.kv_slots, metadata.mask[:, 0], metadata.kv_lens]
        if features is None:
            args.pop(2)
        self.graphs["extend"](*args)

    # ---- capture -----------------------------------------------------------------------------
    def build_graphs(self, worker, kv_width: int, feature_size: int | None, shapes,
                     dormancy: bool = False) -> list[GraphedFunction]:
        """Declares the graphs (captured by the caller with the runner's other graphs): the three
        phases of the configured shape, for steps that run them eagerly between (a grammar with
        penalties, logprobs or top-k, larger batches than the whole iteration's graphs), the whole
        iteration for every sampling kind and every draft shape the policy can choose, and with
        `dormancy` plain decoding's step per sampling kind (batches of dormant rows)."""
        runner, drafter = self.runner, self.drafter
        pool = drafter.pool
        self.graph_kv_width = kv_width
        n, sink_slot, device = self.num_draft_tokens, runner.sink_slot, runner.device
        num_pages = pool.staging_pages.shape[1]
        long, i32 = torch.long, torch.int32
        # Depth of the deepest tree (TreeBuilder.build): decides verify's output and extend's query count.
        self.tree_max_depth = min(drafter.num_steps, n - 1)
        q = self.tree_max_depth + 1
        self.graphs["draft_tree"] = GraphedFunction("draft tree", self._draft_tree_fn, [
            GraphInput((), long, pool.pad_slot), GraphInput((num_pages,), long, runner.sink_page)], device)
        if any(not shape.drafts for shape in shapes):
            self.graphs["catch_up"] = GraphedFunction("draft catch-up", self._catch_up_fn, [
                GraphInput((), long, pool.pad_slot), GraphInput((num_pages,), long, runner.sink_page)], device)

        self.graphs["verify"] = GraphedFunction("verify", self.verify_forward, [
            GraphInput((n,), long, 0),  # tokens
            GraphInput((n,), long, -1),  # parents: every padded node is a root
            GraphInput((n,), long, 0),  # depths
            GraphInput((), long, 0),  # seq_lens
            GraphInput((n,), long, sink_slot),  # node_slots
            GraphInput((n,), long, 0),  # node_cols
            GraphInput((kv_width,), long, sink_slot),  # kv_slots
            GraphInput((n, kv_width), torch.bool, False),  # prefix_mask
        ], device)

        ext = [GraphInput((), long, pool.pad_slot), GraphInput((q,), long, 0)]
        if drafter.model.target_hidden is not None:
            ext.append(GraphInput((q, feature_size), runner.dtype, 0))
        ext += [GraphInput((), long, 1),  # accept_lens
                GraphInput((), long, 0),  # first_pos
                GraphInput((q,), long, sink_slot),  # slot_mapping
                GraphInput((kv_width,), long, sink_slot),  # kv_slots
                GraphInput((q, kv_width), torch.bool, False),  # mask
                GraphInput((), i32, 0)]  # kv_lens
        fn = self._extend_fn
        if drafter.model.target_hidden is None:
            def fn(slots, tokens, *rest):
                return self._extend_fn(slots, tokens, None, *rest)
        self.graphs["extend"] = GraphedFunction("draft extend", fn, ext, device)

        vocab = runner.arch.vocab_size
        for shape in shapes:
            # A constrained step that drafts needs the host between draft and verify (tree masks); one
            # that does not (depth 0) has its single mask before launch and replays a graph too.
            kinds = GRAPHED_SAMPLING + GRAPHED_GENERAL + (GRAPHED_CONSTRAINED if not shape.drafts else ())
            for features in kinds:
                def iteration(slots, page_rows, coins, use_coins, allowed=None, features=features, shape=shape):
                    return worker.decode_iteration(slots, page_rows, coins, use_coins, kv_width, features, shape,
                                                   allowed)

                inputs = [GraphInput((), long, pool.pad_slot), GraphInput((num_pages,), long, runner.sink_page),
                          GraphInput((self.num_nodes(shape),), torch.bool, False), GraphInput((), torch.bool, False)]
                if features.constrained:
                    inputs.append(GraphInput((vocab,), torch.bool, True))  # the root's grammar mask
                self.graphs[_iteration_key(features, shape)] = GraphedFunction(
                    f"whole iteration ({features.name}, {shape.name})", iteration, inputs, device)
            if shape.drafts:
                self._build_split_graphs(worker, shape, kv_width, num_pages, vocab)
        for features in (GRAPHED_SAMPLING + GRAPHED_GENERAL) if dormancy else ():
            def dormant(slots, page_rows, features=features):
                return worker.root_step(slots, page_rows, kv_width, features, defer=False)

            self.graphs[_dormant_key(features)] = GraphedFunction(
                f"dormant decode ({features.name})", dormant,
                [GraphInput((), long, pool.pad_slot), GraphInput((num_pages,), long, runner.sink_page)], device)
        return list(self.graphs.values())


    def _build_split_graphs(self, worker, shape: DraftShape, kv_width: int, num_pages: int, vocab: int) -> None:
        """A constrained drafting step as two graphs, the draft and the rest (verify, accept, commit,
        extend), with the host's tree masks between them. Greedy and sampled (top-p / min-p) steps; with
        top-k they run the phases eagerly."""
        runner, pool, device, long = self.runner, self.drafter.pool, self.runner.device, torch.long
        n = self.num_nodes(shape)

        def draft(slots, page_rows):
            tree = worker.draft_for_iteration(slots, page_rows, kv_width, shape)
            return tree.tokens, tree.parents, tree.depths

        self.graphs[f"draft:{shape.name}"] = GraphedFunction(f"draft ({shape.name})", draft, [
            GraphInput((), long, pool.pad_slot), GraphInput((num_pages,), long, runner.sink_page)], device)
        for features in GRAPHED_CONSTRAINED[:2]:
            def rest(slots, page_rows, tokens, parents, depths, coins, use_coins, allowed, features=features):
                if not shape.tree:
                    # A chain's depths are its node indices. The padded rows' inputs are not a chain (all
                    # depth 0): their accepted nodes would collide in the accepted path.
                    depths = torch.arange(n, device=tokens.device).expand(tokens.shape[0], n)
                return worker.verify_and_commit(slots, page_rows, self._tree(shape, tokens, parents, depths), coins, use_coins, kv_width, features, shape,
                                                allowed.reshape(-1, vocab))

            self.graphs[_verify_commit_key(features, shape)] = GraphedFunction(
                f"verify and commit ({features.name}, {shape.name})", rest, [
                    GraphInput((), long, pool.pad_slot), GraphInput((num_pages,), long, runner.sink_page),
                    GraphInput((n,), long, 0), GraphInput((n,), long, -1), GraphInput((n,), long, 0),
                    GraphInput((n,), torch.bool, False), GraphInput((), torch.bool, False),
                    GraphInput((n, vocab), torch.bool, True)], device)


def _verify_commit_key(features: SamplingFeatures, shape: DraftShape) -> str:
    return f"verify_commit:{features.name}:{shape.name}"


def _dormant_key(features: SamplingFeatures) -> str:
    return f"dormant:{features.name}"


def _iteration_key(features: SamplingFeatures, shape: DraftShape) -> str:
    return f"iteration:{features.name}:{shape.name}"
