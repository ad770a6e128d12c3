"""A rank's worker: its shard of the model and of the state, and what each plan makes it do.

Every rank runs one ``Worker``, rank 0 included: the engine core's executor hands each step's
message (``plan.py``) to every rank's worker, rank 0's in process (``executor.py``). A worker
holds its rank's model runner, its page executor (and tier worker), a sharded draft where there
is one, and with a PD role its transfer agent (``tandem/disagg/pd_ranks.py``: rank 0's too,
opened when the PD side asks, which hands it its operations in process). ``execute`` is the one forward pass every rank
runs for a STEP plan (``ModelRunner.run``: the graph replay or eager pass, the LM head over the
prompt-logit ranges, the layers' collectives in the same order on every rank); ``draft`` the one
pass of a sharded draft for a DRAFT plan. Rank 0 reads what they return; the others discard it.
Rank 0's worker also samples: ``sample`` runs a sampling message (``sampling_plan.py``) on the
logits of the forward pass it ran last, with the sampler and the per-sequence generators it owns
(``worker/rank_sampling.py``), keeps the sampled token ids on its device (the next step's pending
input tokens: the overlapped loop) and returns the handle of their copy to the host; ``verify``
runs a speculating step's verification message likewise and returns its verdicts as host values;
``draft_pass`` runs one of speculation's proposer's draft passes (``spec_decode/rank_drafts.py``:
the draft's forward pass and its draws, from a host-only message) and ``end_proposal`` returns
the drafts as host ids. A speculating step's hidden states stay here for the draft's passes.

Ranks 1..N-1 are processes rank 0 starts (``launcher.py``) or Ray actors (``ray_worker.py``).
Each joins the groups first (so a failure after that reaches rank 0 through the collectives),
builds its shard exactly as rank 0 builds its own (``build.py``: same config, its own rank),
agrees on the page counts (and the host tier's), then loops (``serve_plans``): receive a plan,
apply its page operations to this rank's shard through the same ``PageExecutor`` rank 0 applied
them with (``kv/page_operations.py``; the tiers' kinds through this rank's ``TierWorker``), then
do what the plan says. Such a rank samples nothing and keeps no scheduler: its page tables arrive
in every plan. It exits on a STOP plan; if rank 0 dies, the kernel kills it (``PR_SET_PDEATHSIG``)
and a pending collective fails. With a PD role its transfer agent is driven by TRANSFER plans
instead of a forward pass (``pd_ranks.py``).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Optional

import msgspec
import torch

from tandem.config import EngineConfig
from tandem.engine.ranks.plan import StepOutput
from tandem.kv.block_pool import SanitizerError
from tandem.parallel.control import smallest
from tandem.structured.bitmask import bitmask_words
from tandem.worker.host_logprobs import HostLogprobs
from tandem.worker.rank_sampling import RankSampling
from tandem.worker.rank_verification import verify
from tandem.worker.step_inputs import feed_pending

if TYPE_CHECKING:
    from tandem.engine.ranks.build import RankParts
    from tandem.engine.ranks.plan import DraftPlan, ForwardPlan, StepPlan
    from tandem.engine.ranks.sampling_plan import SamplingPlan
    from tandem.parallel.vocab_choice import VocabChoice
    from tandem.spec_decode.draft_pass_plan import DraftPassPlan, ProposalEnd, ProposalOutput
    from tandem.worker.graph_choice import GraphChoice
    from tandem.worker.model_runner import ForwardOutput
    from tandem.worker.sampler import HostSamplerOutput, SamplerOutput
    from tandem.worker.verify_plan import VerifyOutput, VerifyPlan

logger = logging.getLogger("tandem.parallel")


def main() -> None:
    """``python -m tandem.engine.ranks.worker RANK SIZE PORT LOG_LEVEL``, the config (JSON) on stdin."""
    from tandem.engine.ranks.launcher import config_from_json

    rank, size, port = (int(value) for value in sys.argv[1:4])
    run_worker(config_from_json(sys.stdin.buffer.read()), rank, size, port, sys.argv[4])


def run_worker(config: EngineConfig, rank: int, size: int, port: int, log_level: str = "info") -> None:
    from tandem.engine.memory import resolve_device
    from tandem.engine.process import die_with_parent
    from tandem.parallel.group import join, rank_device

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop (a STOP plan)
    die_with_parent()  # (its OpenMP threads sleep when idle: the launcher set that before torch loaded here)
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    groups = join(rank, size, device, port=port, custom_all_reduce=not config.disable_custom_all_reduce)
    serve_plans(config, groups, device)


def serve_plans(config: EngineConfig, groups, device: torch.device) -> None:
    """Ranks 1..N-1: build this rank's worker, then carry out rank 0's plans until the STOP plan."""
    from tandem.engine.ranks.plan import PlanChannel

    worker = Worker.build(config, groups, device)
    channel = PlanChannel(groups.control, groups.rank)
    logger.info("tensor-parallel rank %d of %d ready on %s", groups.rank, groups.size, device)
    profile_directory = os.environ.get("TANDEM_RANK_PROFILE")
    if not profile_directory:
        _serve_until_stopped(worker, channel)
        return
    import cProfile  # (where this rank's host time goes: benchmarks/offline.py --host-profile)

    profiler = cProfile.Profile()
    profiler.runcall(_serve_until_stopped, worker, channel)
    profiler.dump_stats(os.path.join(profile_directory, f"rank{groups.rank}.prof"))


def _serve_until_stopped(worker: "Worker", channel) -> None:
    while worker.serve(channel.receive()):
        pass


class WorkerGroup:
    """A worker rank's side of the start-up agreements (``build.RankGroup``), over the control
    group: the same collectives, in the same order, as rank 0's executor makes them."""

    def __init__(self, groups) -> None:
        self.groups = groups
        self.shard = groups.shard

    def agree_on_pages(self, plan):
        from tandem.engine.ranks.launcher import agree_on_pages

        return agree_on_pages(plan, self.groups.control)

    def agree_on_count(self, count: int) -> int:
        return smallest(self.groups.control, count)

    def attach(self, coordinator, runner) -> None:
        return None  # rank 0's plans drive this rank: nothing of its own is handed on

    def capture_graphs(self, runner, batch_sizes: list[int], max_model_len: int,
                       max_num_batched_tokens: int) -> list[int]:
        from tandem.parallel.graphs import capture_on_every_rank

        return capture_on_every_rank(runner, self.groups, batch_sizes, max_model_len, max_num_batched_tokens)

    def capture_mixed_graphs(self, runner, token_sizes: list[int]) -> list[int]:
        from tandem.parallel.graphs import capture_mixed_on_every_rank

        return capture_mixed_on_every_rank(runner, self.groups, token_sizes)


class Worker:
    """One rank's shard of the model and of the state (``build_rank``'s parts), and what each
    kind of plan makes it do (the module docstring). Owner: rank 0's engine core (through its
    executor) or, on ranks 1..N-1, ``serve_plans``."""

    def __init__(self, parts: "RankParts", groups=None, transfers=None) -> None:
        self.groups = groups  # ranks 1..N-1: the rank's groups (its answers go over the control group)
        self.coordinator, self.runner = parts.coordinator, parts.runner
        self.pages = self.coordinator.outbox.executor  # this rank's page executor (every rank's: the same class)
        self.tiers = self.pages.tiers  # this rank's tier worker (rank 0's books drive theirs through the outbox)
        # A draft model runs on rank 0 alone: on the other ranks its state groups exist (the same
        # group ids), unused, and its layers' loads (registered there too) are waited for after
        # each forward pass. An MTP module is sharded as the target is: every rank runs its passes.
        self.network = parts.draft
        self.unread_layers = ([] if self.network is not None else
                              [name for name in parts.registry.layer_names() if name not in self.runner.graph_layers])
        self.parallel = self.runner.model.tensor_shard.is_parallel
        self.transfers = transfers  # with a PD role: this rank's transfer agent (pd_ranks.py; rank 0's: open_transfers)
        # Rank 0 samples (``sample``): its sampler, parameter tables and per-sequence generators,
        # and the logits of the last forward pass, which the next sampling message reads (or,
        # for a step planned to choose per vocabulary shard, what the ranks gathered for it).
        self.sampling = RankSampling(parts.config.seed, self.runner.device, bitmask_words(parts.model_info.vocab_size))
        self.logits: Optional[torch.Tensor] = None
        self.choice: Optional["VocabChoice"] = None
        # Rank 0 on CUDA: a timing event where the last forward pass began (the scheduler's step
        # time fit reads the device's time from it to the sampled tokens' copy).
        self.step_began: Optional[torch.cuda.Event] = None
        self.sampled_token_ids: Optional[torch.Tensor] = None  # [rows] of the last sampling message
        self.sampled: Optional["SamplerOutput"] = None  # the last sampling message's output, on the device
        self.reads_output = groups is None  # rank 0 (the engine core's process) reads its steps' outputs
        self.times_steps = self.reads_output and self.runner.device.type == "cuda"
        self.vocab_size = parts.model_info.vocab_size
        # Speculation (rank 0): the last step's hidden states where its plan asked for them (the
        # draft's passes read them), and the proposer's side that runs those passes.
        self.hidden: Optional[torch.Tensor] = None
        self.drafts = None
        if self.network is not None and self.reads_output:
            from tandem.spec_decode.rank_drafts import RankDrafts

            rows_as_decode = not self.coordinator.speculation.copies_needed(self.network.groups)
            self.drafts = RankDrafts(self.runner, self.network, self.sampling, rows_as_decode)
        self.capture_draft_graphs()

    @classmethod
    def build(cls, config: EngineConfig, groups, device: torch.device) -> "Worker":
        """Ranks 1..N-1: this rank's shard (``build_rank``, as rank 0 builds its own), then its PD
        transfer agent, made last as rank 0 makes its PD side."""
        import uuid

        from tandem.disagg.pd_ranks import RankTransfers
        from tandem.engine.ranks.build import build_rank

        parts = build_rank(config, device, WorkerGroup(groups), rank=groups.rank)
        transfers = None
        if config.transfer is not None:
            name = f"tandem-{config.transfer.role}-{uuid.uuid4().hex[:16]}-rank{groups.rank}"
            transfers = RankTransfers(config.transfer, groups.rank, parts.registry, name)
            transfers.announce(groups.control)
        return cls(parts, groups, transfers)

    def open_transfers(self, transfer, name: str):
        """Rank 0: its PD transfer agent, made when the PD side asks (the last thing rank 0's
        engine builds) and named ``name`` (the engine's id, the sender of its notifications)."""
        from tandem.disagg.pd_ranks import RankTransfers

        self.transfers = RankTransfers(transfer, 0, self.coordinator.registry, name)
        return self.transfers

    def close_transfers(self) -> None:
        if self.transfers is not None:
            self.transfers.close()
            self.transfers = None

    def execute(self, plan: "ForwardPlan") -> "StepOutput":
        """The forward pass of a STEP plan (``plan.ForwardPlan``), as every rank runs it
        (``ModelRunner.run``: hidden states, sampled rows' logits, each prompt range's logits);
        the sampled rows' logits stay here for the sampling message. Rank 0 first writes the
        tokens it sampled last, still on its device, into the input rows the plan names (and
        broadcasts the input ids). Rank 0's worker then reads the output (``_output``); the
        other ranks' return nothing of it."""
        if self.times_steps:
            self.step_began = torch.cuda.Event(enable_timing=True)
            self.step_began.record()
        feed = None
        if plan.pending_targets:
            feed = feed_pending(self.sampled_token_ids, plan.pending_targets, plan.pending_sources)
        output = self.runner.run(plan.inputs, plan.graph_size, plan.prompt_logit_ranges, feed,
                                 broadcast_inputs=plan.inputs_from_root and self.parallel, graph_rows=plan.graph_rows,
                                 vocab_choice=plan.vocab_choice, choice_top=plan.choice_top)
        for name in self.unread_layers:  # (after the forward pass: its own layers load first)
            self.coordinator.pending_loads.wait(name)
        self.logits, self.choice = output.logits, output.choice
        self.hidden = output.hidden if plan.hidden_states else None
        if not self.reads_output:
            return StepOutput([])
        return self._output(plan, output)

    def _output(self, plan: "ForwardPlan", output: "ForwardOutput") -> "StepOutput":
        """Rank 0's output of a step: non-finite logits are a sanitizer error (a forward pass
        read poisoned, freed, state); each prompt range's logprobs of its target tokens, as host
        values (the hidden states, where the plan asks for them, stay here: ``draft_pass``)."""
        if self.coordinator.sanitizer.enabled and not finite_logits(output):
            raise SanitizerError("non-finite logits: a forward pass read poisoned (freed) state")
        prompt_logprobs = [HostLogprobs.compute(logits, targets, top)
                           for logits, targets, top in zip(output.prompt_logits, plan.prompt_targets, plan.prompt_top)]
        return StepOutput(prompt_logprobs)

    def sample(self, plan: "SamplingPlan") -> Optional["HostSamplerOutput"]:
        """Rank 0: the tokens of a sampling message (``sampling_plan.py``), sampled from the last
        forward pass's logits on the device; their token ids stay here (the next step's pending
        input tokens read them) and the tokens and logprobs start their one copy to the host,
        whose handle is returned (not waited for). Then the generators of the sequences that
        ended go. A plan without rows only drops generators (None)."""
        host = None
        if plan.num_rows:
            sampled = self._sample_rows(plan)
            self.sampled, self.sampled_token_ids = sampled, sampled.token_ids
            host = sampled.to_host_async(self.step_began)
        self.forget(plan.finished_keys)
        return host

    def _sample_rows(self, plan: "SamplingPlan") -> "SamplerOutput":
        """The sampled rows' tokens on the device: merged from what the ranks gathered where the
        step was planned to choose per vocabulary shard, else sampled from the logits."""
        if self.choice is not None:
            choice = self.choice if plan.logits_rows is None else self.choice.rows(plan.logits_rows)
            return self.sampling.greedy_from_choice(choice, plan.params, plan.banned_token_ids, plan.token_bitmask)
        logits = self.logits if plan.logits_rows is None else self.logits[plan.logits_rows]
        return self.sampling.sample(logits, plan.keys, plan.params, plan.seeds, plan.prompt_token_ids,
                                    plan.output_token_ids, plan.banned_token_ids, plan.token_bitmask)

    def forget(self, keys: list[int]) -> None:
        """Rank 0: drop what it keeps of sequences that ended (generators, drafts' distributions,
        carried hidden states)."""
        self.sampling.forget(keys)
        if self.drafts is not None:
            self.drafts.forget(keys)

    def live_keys(self) -> set[int]:
        """The sequence keys rank 0 keeps anything under (the sanitizer: none outlives its sequence)."""
        return self.sampling.live_keys() | (self.drafts.live_keys() if self.drafts is not None else set())

    def verify(self, plan: "VerifyPlan") -> "VerifyOutput":
        """Rank 0: the verdicts of a verification message (``worker/verify_plan.py``) on the last
        forward pass's logits, with the sampler, generators and drafts' distributions it owns
        (``worker/rank_verification.py``): host values, after one copy."""
        if self.logits is None:
            raise RuntimeError("a verification message after a step planned to choose per vocabulary shard")
        return verify(self.logits, plan, self.sampling)

    def draft_pass(self, plan: "DraftPassPlan", executor=None) -> Optional[list[int]]:
        """Rank 0: one of the proposer's draft passes (``spec_decode/rank_drafts.py``), its rows
        reading the last step's hidden states where they name them; a sharded draft's pass goes
        to every rank through ``executor`` (``execute_draft``). The drawn ids where asked (host)."""
        return self.drafts.run_pass(plan, self.hidden, executor)

    def end_proposal(self, plan: "ProposalEnd") -> "ProposalOutput":
        """Rank 0: the proposal's drafts as host ids; their distributions stay for the verification."""
        return self.drafts.end(plan)

    def keep_carried_hidden(self, key: int, values: list[float]) -> None:
        """Rank 0 (PD decode, MTP): the hidden state the prefill server sent for the sequence."""
        self.drafts.keep_carried_hidden(key, values)

    def skip_first_draw(self, key: int, seed: Optional[int]) -> None:
        """Rank 0 (PD decode): a seeded sequence's generator skips the draw the prefill engine
        made for its first token (one vocabulary-sized Exp(1) vector: ``Sampler.exponential_noise``)."""
        generator = self.sampling.generator(key, seed)
        if generator is not None:
            torch.empty(self.vocab_size, device=generator.device).exponential_(generator=generator)

    def capture_draft_graphs(self) -> None:
        """Where the target replays CUDA graphs (verification steps too: ``build.py``), a draft
        that runs on this rank alone gets graphs of its own at the same sizes when its layers are
        graph-safe (a CPU test replays the forward eagerly over the static buffers)."""
        from tandem.worker.cuda_graphs import CudaGraphRunner, model_is_graph_safe

        target_graphs, network = self.runner.graphs, self.network
        if target_graphs is None or network is None:
            return
        if model_is_graph_safe(network.module) and not network.runs_on_every_rank:
            network.graphs = CudaGraphRunner(self.runner, target_graphs.batch_sizes, target_graphs.max_width,
                                             network=network)
            if self.runner.device.type == "cuda":
                network.graphs.capture()

    def draft(self, plan: "DraftPlan", input_ids: Optional[torch.Tensor] = None,
              hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A sharded draft's pass of a DRAFT plan (``plan.DraftPlan``), as every rank runs it: the
        output hidden state of every row token. Rank 0 passes its device input ids and hidden
        inputs, which it broadcasts; the other ranks receive them."""
        from tandem.spec_decode.draft_batch import run_planned_rows

        return run_planned_rows(self.runner, self.network, plan.inputs, plan.inputs_from_root, plan.hidden_dtype,
                                input_ids, hidden)

    def graph_choice(self) -> "GraphChoice":
        """What this rank captured, as the graph choice reads it (host values): rank 0's worker
        gives it to the engine core's step planner at start-up (``worker/graph_choice.py``)."""
        return self.runner.graph_choice()

    def release_graphs(self) -> None:
        """Before the process group goes (``ModelRunner.release_graphs``)."""
        self.runner.release_graphs()

    def serve(self, plan: "StepPlan") -> bool:
        """Ranks 1..N-1: carry out one plan received from rank 0; False once it was the STOP plan."""
        from tandem.engine.ranks.plan import DISK, DRAFT, PAGES, RPC, STOP, TRANSFER

        self.pages.apply_all(plan.page_operations)
        if self.tiers is not None:
            self.tiers.poll()
        if plan.kind == STOP:
            self.release_graphs()
            if self.transfers is not None:
                self.transfers.close()
            if self.tiers is not None:
                self.tiers.close()  # (queued store writes finish first)
            return False
        if plan.kind == TRANSFER:
            self.transfers.serve(plan.transfer_operations, self.groups.control)
        elif plan.kind == DISK:  # how many of the pages this rank has; every rank takes the fewest
            self.tiers.keep(smallest(self.groups.control, self.tiers.readable(plan.disk_keys)))
        elif plan.kind == RPC:
            self._answer(plan.rpc_method, msgspec.msgpack.decode(plan.rpc_arguments))
        elif plan.kind == DRAFT:
            self.draft(plan.draft_plan())
        elif plan.kind != PAGES:
            self.execute(plan.forward_plan())
        return True

    def _answer(self, method: str, arguments: list) -> None:
        """This rank's answer to a ``collective_rpc`` (gathered by rank 0)."""
        from tandem.engine.ranks.executor import rank_call
        from tandem.parallel.control import exchange

        answer = rank_call(method)(self, *arguments)
        exchange(self.groups.control, msgspec.msgpack.encode(answer))


def finite_logits(output: "ForwardOutput") -> bool:
    """Whether a step's sampled rows read as finite: their logits, or where the choice was made per
    vocabulary shard what the ranks gathered for it (``VocabChoice.finite``)."""
    if output.choice is not None:
        return output.choice.finite()
    return bool(torch.isfinite(output.logits).all())


if __name__ == "__main__":
    main()
