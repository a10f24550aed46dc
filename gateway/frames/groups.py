"""A frame's screened requests, in groups that routing decides once each.

Members of a group share what routing's plan and calibration are keyed by (model, version, priority,
kind, size bucket, whether they have a deadline; the frame's region) and their client hint (clients send
a few values, and a hint raises a score across tier thresholds); the rest (work within the bucket,
remaining deadline) is kept as a range, which :meth:`routing.TierPolicy.decide_range` turns
into one decision valid for all of them, or refuses to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edgewire import pb
from inference.profile import Sizes, profile_from, sizes_of
from routing.complexity import ComplexityEstimator
from routing.types import Priority, RequestKind, RequestProfile

GroupKey = tuple[str, str, Priority, RequestKind, int, float, bool]


@dataclass(slots=True)
class Group:
    """The requests of one frame that routing sees alike, in frame order, with the ranges of the rest."""

    members: list[int] = field(default_factory=list)  # indices into the frame's screened requests
    least_work: float = math.inf
    least: int = 0  # index of the member with the least work
    most_work: float = -math.inf
    most: int = 0
    hint_low: float = math.inf
    hint_high: float = -math.inf
    deadline_low: float = math.inf
    deadline_high: float = -math.inf

    def add(self, index: int, work: float, hint: float, remaining: float | None) -> None:
        self.members.append(index)
        if work < self.least_work:
            self.least_work, self.least = work, index
        if work > self.most_work:
            self.most_work, self.most = work, index
        self.hint_low = min(self.hint_low, hint)
        self.hint_high = max(self.hint_high, hint)
        if remaining is not None:
            self.deadline_low = min(self.deadline_low, remaining)
            self.deadline_high = max(self.deadline_high, remaining)


@dataclass(slots=True)
class Screened:
    """The requests of a frame that passed screening, in frame order, with what routing reads of each."""

    requests: list[pb.InferRequest] = field(default_factory=list)
    priorities: list[Priority] = field(default_factory=list)
    remaining: list[float | None] = field(default_factory=list)
    sizes: list[Sizes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: pb.InferRequest, priority: Priority, remaining: float | None) -> None:
        self.requests.append(request)
        self.priorities.append(priority)
        self.remaining.append(remaining)
        self.sizes.append(sizes_of(request))

    def subset(self, indices: list[int]) -> Screened:
        """The requests at ``indices`` (in that order) as a frame's screened requests of their own."""
        out = Screened()
        out.requests = [self.requests[i] for i in indices]
        out.priorities = [self.priorities[i] for i in indices]
        out.remaining = [self.remaining[i] for i in indices]
        out.sizes = [self.sizes[i] for i in indices]
        return out

    def profile(self, index: int, region: str) -> RequestProfile:
        """Member ``index``'s routing profile, as :func:`inference.profile.profile_of` builds it."""
        return profile_from(
            self.requests[index], self.sizes[index], self.priorities[index], self.remaining[index], region
        )

    def groups(self, estimator: ComplexityEstimator) -> list[Group]:
        """The screened requests grouped for routing, groups in the order of their first member."""
        groups: dict[GroupKey, Group] = {}
        work_of = estimator.work_of
        # Group.add inlined: this loop runs for every request of every frame. A group's key holds its hint,
        # so its members share one (hint_low == hint_high, set as the group is made).
        isnan = math.isnan
        for index, (request, sizes, priority, remaining) in enumerate(
            zip(self.requests, self.sizes, self.priorities, self.remaining, strict=True)
        ):
            work = work_of(*sizes)
            # As routing reads a hint: clamped to [0, 1], NaN none (apply_hint), like 0.
            hint = request.complexity_hint
            if hint != 0.0:
                hint = 0.0 if isnan(hint) else (0.0 if hint < 0.0 else 1.0 if hint > 1.0 else hint)
            key = (
                request.model_name,
                request.model_version,
                priority,
                sizes[0],
                int(work).bit_length() if work > 0 else 0,
                hint,
                remaining is None,
            )
            group = groups.get(key)
            if group is None:
                group = groups[key] = Group([index], work, index, work, index, hint, hint)
                if remaining is not None:
                    group.deadline_low = group.deadline_high = remaining
                continue
            group.members.append(index)
            if work < group.least_work:
                group.least_work, group.least = work, index
            elif work > group.most_work:
                group.most_work, group.most = work, index
            if remaining is not None:
                if remaining < group.deadline_low:
                    group.deadline_low = remaining
                elif remaining > group.deadline_high:
                    group.deadline_high = remaining
        return list(groups.values())

    def halves(self, group: Group, estimator: ComplexityEstimator) -> tuple[Group, Group] | None:
        """``group`` cut in two at its median work (less work in the first), or None when all its members
        have the same work (a range that straddles a tier threshold becomes two that may not); its members'
        work counted again by ``estimator`` (:meth:`groups`' own; few groups are cut)."""
        work_of, sizes = estimator.work_of, self.sizes
        work = {index: work_of(*sizes[index]) for index in group.members}
        members = sorted(group.members, key=work.__getitem__)
        middle = len(members) // 2
        if work[members[0]] == work[members[-1]]:
            return None
        while middle < len(members) and work[members[middle]] == work[members[middle - 1]]:
            middle += 1  # equal work stays on one side
        if middle == len(members):
            middle = len(members) // 2
            while work[members[middle]] == work[members[middle - 1]]:
                middle -= 1
        return self._group(sorted(members[:middle]), work, group.hint_low), self._group(
            sorted(members[middle:]), work, group.hint_low
        )

    def _group(self, members: list[int], work: dict[int, float], hint: float) -> Group:
        group = Group()
        for index in members:
            group.add(index, work[index], hint, self.remaining[index])
        return group

    def bounds(self, group: Group, region: str) -> tuple[RequestProfile, RequestProfile]:
        """The group's low and high profiles for :meth:`routing.TierPolicy.decide_range`."""
        has_deadline = self.remaining[group.members[0]] is not None
        low, high = group.least, group.most
        return (
            profile_from(
                self.requests[low],
                self.sizes[low],
                self.priorities[low],
                group.deadline_low if has_deadline else None,
                region,
                group.hint_low,
            ),
            profile_from(
                self.requests[high],
                self.sizes[high],
                self.priorities[high],
                group.deadline_high if has_deadline else None,
                region,
                group.hint_high,
            ),
        )
