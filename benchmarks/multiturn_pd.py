"""Multi-turn conversations over PD, decode offload on against off (``multiturn.py --pd``).

A prefill engine and a decode engine (NIXL transfers, ZMQ control channel, as in two servers)
run in this process, stepped in turn, and name one store (``--disk-cache-dir``, a temporary
directory). Each round's prompt is the user's whole conversation so far plus a new message;
every user's round r is submitted together. Without decode offload the prefill engine
recomputes each previous answer (its own cache holds only what it prefilled); with it, the
decode engine has written the answer's pages to the store and the prefill engine loads them.
The next round starts once the offload has landed (a user reads the answer first).

Printed per setting: TTFT p50/p90 of rounds 2..R (submission to the first token the decode
engine delivers), the prefill engine's prompt tokens by source (its device cache, the store by
who wrote the pages, computed) and what the decode engine offloaded.
"""
from __future__ import annotations

import random
import tempfile
import time


def make_pair(model_dir: str, args, store: str, offload: bool, longest: int):
    from tandem.config import EngineConfig
    from tandem.engine.core import EngineCore
    from tandem.transfer.config import TransferConfig

    common = dict(model=model_dir, dtype=args.dtype, load_format=args.load_format, max_model_len=longest,
                  max_num_batched_tokens=8192, max_num_seqs=max(args.users, 1), disk_cache_dir=store,
                  max_total_tokens=args.device_pool_tokens or args.users * longest + 1024)
    # One thread steps both engines (and builds one while the other waits): generous timeouts.
    patience = dict(peer_timeout=600.0, bootstrap_timeout=600.0, transfer_timeout=600.0)
    prefill = EngineCore(EngineConfig(**common, transfer=TransferConfig(role="prefill", **patience)))
    decode = EngineCore(EngineConfig(**common, decode_offload=offload,
                                     transfer=TransferConfig(role="decode", **patience)))
    return prefill, decode


def run_round(prefill, decode, prompts: list[list[int]], output_len: int, round_number: int):
    """Both legs of every prompt; step both engines until the decode engine finished them all."""
    from tandem import SamplingParams
    from tandem.protocol import EngineRequest, TransferParams
    from tandem.transfer.messages import new_room

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    address = prefill.pd.channel.address
    submitted = time.perf_counter()
    ids = [f"u{user}r{round_number}" for user in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        room = new_room()
        prefill.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                          transfer=TransferParams(room=room, role="prefill")))
        decode.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                         transfer=TransferParams(room=room, role="decode", prefill_address=address)))
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
    finished: set[str] = set()
    while len(finished) < len(ids):
        prefill.step()
        for delta in decode.step():
            if delta.error:
                raise RuntimeError(f"{delta.request_id}: {delta.error}")
            first.setdefault(delta.request_id, time.perf_counter() - submitted)
            outputs[delta.request_id].extend(delta.new_token_ids)
            if delta.finish_reason:
                finished.add(delta.request_id)
    decode.tiers.drain()  # the answer's pages land before the user's next message
    return [first[request_id] for request_id in ids], [outputs[request_id] for request_id in ids]


def conversations_pd(model_dir: str, args, vocab_size: int, offload: bool) -> dict:
    rng = random.Random(0)
    histories = [[rng.randrange(10, vocab_size) for _ in range(args.first_len)] for _ in range(args.users)]
    longest = args.first_len + (args.rounds - 1) * args.message_len + args.rounds * args.output_len + 16
    with tempfile.TemporaryDirectory(prefix="tandem-store-") as store:
        prefill, decode = make_pair(model_dir, args, store, offload, longest)
        try:
            later_ttfts = []
            for round_number in range(args.rounds):
                if round_number:
                    for history in histories:
                        history.extend(rng.randrange(10, vocab_size) for _ in range(args.message_len))
                ttfts, outputs = run_round(prefill, decode, [list(h) for h in histories], args.output_len,
                                           round_number)
                if round_number:
                    later_ttfts += ttfts
                for history, output in zip(histories, outputs):
                    history.extend(output)
            stats, offloaded = prefill.stats(), decode.stats().tiers
            tiers = stats.tiers
            store_hits = dict(tiers.disk_hit_tokens_by_origin)
            return dict(ttfts=later_ttfts, device=stats.prefix_cache_hit_tokens - tiers.host_hit_tokens
                        - tiers.disk_hit_tokens, host=tiers.host_hit_tokens, store=store_hits,
                        computed=stats.prefix_cache_query_tokens - stats.prefix_cache_hit_tokens,
                        offloaded_pages=offloaded.offloaded_pages, offloaded_bytes=offloaded.offloaded_bytes)
        finally:
            prefill.shutdown()
            decode.shutdown()


def report_pd(model_dir: str, args, vocab_size: int, percentile) -> None:
    results = {name: conversations_pd(model_dir, args, vocab_size, offload)
               for name, offload in (("offload off", False), ("offload on", True))}
    print(f"\nPD, {args.users} users x {args.rounds} rounds: first prompt {args.first_len}, messages "
          f"{args.message_len}, answers {args.output_len} tokens; TTFT of rounds 2..{args.rounds}")
    print(f"{'decode':<14}{'TTFT p50 (ms)':>14}{'TTFT p90 (ms)':>14}{'prefill: device':>17}{'host':>7}"
          f"{'store (by writer)':>26}{'computed':>10}{'offloaded pages':>17}")
    for name, figures in results.items():
        store = ", ".join(f"{origin} {count}" for origin, count in sorted(figures["store"].items())) or "0"
        print(f"{name:<14}{percentile(figures['ttfts'], 0.5) * 1e3:>14.1f}{percentile(figures['ttfts'], 0.9) * 1e3:>14.1f}"
              f"{figures['device']:>17}{figures['host']:>7}{store:>26}{figures['computed']:>10}"
              f"{figures['offloaded_pages']:>17}")
    off, on = results["offload off"]["ttfts"], results["offload on"]["ttfts"]
    print(f"TTFT p50 ratio off/on: {percentile(off, 0.5) / percentile(on, 0.5):.2f}x; "
          f"p90: {percentile(off, 0.9) / percentile(on, 0.9):.2f}x")
