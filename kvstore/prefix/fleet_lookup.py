"""Prefix reuse across a fleet: what ``Lookup`` asks the shared tiers (metadata = "shared").

A node knows the chunks it spilled or read and what its tiers listed at open, not what
another node spilled since. ``held_chains`` walks a request's chain keys (hashed lazily,
``kvstore.format.keys.iter_chain_keys``): first those this node knows (no I/O), then it
asks the shared tiers about the rest, Redis first, then the bucket, and learns what they
hold, so that the lookup (``kvstore.prefix.chains.longest_prefix``) and a spill naming
those chunks by key find them.

Every chunk of the answer is asked about (its digest is what only the tier can tell);
chain keys are prefix-ordered, so the walk stops at the first chunk held nowhere. Bounds:

* Redis (``RedisTier.find_chains``) is asked in rounds of ``first_round`` chain keys,
  doubling to ``max_round``, until a round is not held whole: about 2 log2(n) round trips
  for n held chunks.
* The bucket (``ObjectTier.find_chains``: one LIST per chain key) only for the chain keys
  Redis lacks, in groups of 1, 2, 4 .. ``bucket_group``, at most ``bucket_probes`` per
  lookup.
* At most ``max_chunks`` chain keys past the node's own prefix are hashed or asked about.

A lookup stopped by a bound answers a shorter prefix, never a wrong one; what it learnt
stays known. The tiers are asked only keys computed in the caller's dedupe domain, so no
probe can find another domain's chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from kvstore.placement.stack import TierStack
from kvstore.prefix.chains import ChainIndex


@dataclass(frozen=True)
class PrefixProbes:
    first_round: int = 8  # chain keys asked in a lookup's first round
    max_round: int = 512  # a round's chain keys at most (doubling from first_round)
    max_chunks: int = 4096  # chain keys past the node's own prefix hashed or asked about
    bucket_group: int = 16  # LISTs in flight at once (groups double from 1)
    bucket_probes: int = 64  # LISTs per lookup at most


PROBES = PrefixProbes()


class _Bucket:
    """The durable shared tier's budget and group size, across a lookup's rounds."""

    def __init__(self, probes: PrefixProbes) -> None:
        self.left, self.group, self.most = probes.bucket_probes, 1, probes.bucket_group

    async def ask(self, stack: TierStack, j: int, chains: list[str]) -> None:
        """Ask about ``chains`` in order until one is missing (the prefix ends there)."""
        done = 0
        while done < len(chains) and self.left > 0:
            take = chains[done : done + min(self.group, self.left)]
            found = await stack.find_chains(j, take)
            self.left -= len(take)
            done += len(take)
            if len(found) < len(take):
                return
            self.group = min(2 * self.group, self.most)


async def held_chains(stack: TierStack, index: ChainIndex, chains: Iterator[str],  # noqa: C901 - one walk down the chain with its probe bounds
                      probes: PrefixProbes = PROBES) -> list[str]:
    """The chain keys from the first whose chunks this node knows or the shared tiers
    hold (learnt now), up to the first held nowhere or a bound."""
    held: list[str] = []
    pending: list[str] = []
    for chain in chains:  # what this node knows: no I/O
        if not index.blocks(chain):
            pending.append(chain)
            break
        held.append(chain)
    tiers = stack.shared_tiers()
    if not pending or not tiers:
        return held
    bucket = _Bucket(probes)
    size, asked = probes.first_round, 0
    while asked < probes.max_chunks:
        room = min(size, probes.max_chunks - asked)
        batch = pending + list(islice(chains, max(0, room - len(pending))))
        pending = []
        if not batch:
            break
        asked += len(batch)
        for j in tiers:
            unknown = [chain for chain in batch if not index.blocks(chain)]
            if not unknown:
                break
            if stack.tiers[j].durable:
                await bucket.ask(stack, j, unknown)
            else:
                await stack.find_chains(j, unknown)
        for chain in batch:
            if not index.blocks(chain):
                return held
            held.append(chain)
        size = min(2 * size, probes.max_round)
    return held


async def learn_each(stack: TierStack, index: ChainIndex, chains: list[str],
                     probes: PrefixProbes = PROBES) -> None:
    """Independent chunks (no prefix to stop at): ask the shared tiers about the chain keys
    this node knows no version of, Redis in rounds of ``max_round``, the bucket at most
    ``bucket_probes`` LISTs, at most ``max_chunks`` keys in all; learn what they hold."""
    unknown = [chain for chain in chains if not index.blocks(chain)][:probes.max_chunks]
    for j in stack.shared_tiers():
        unknown = [chain for chain in unknown if not index.blocks(chain)]
        if not unknown:
            return
        if stack.tiers[j].durable:
            for start in range(0, min(len(unknown), probes.bucket_probes),
                               probes.bucket_group):
                await stack.find_chains(j, unknown[start:min(start + probes.bucket_group,
                                                              probes.bucket_probes)])
        else:
            for start in range(0, len(unknown), probes.max_round):
                await stack.find_chains(j, unknown[start:start + probes.max_round])
