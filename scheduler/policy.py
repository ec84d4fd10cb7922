"""The scheduling policy (--scheduling-policy, vLLM's): where a request joins the waiting queue
and which running request is preempted when the KV pool is short.

fcfs: arrival order; a preempted request goes back to the front (it arrived before every waiting
one) and the newest running request is the victim. priority: (priority, arrival time) order, a
lower priority value first; the running request last in that order is the victim."""

from __future__ import annotations

from collections import deque

from scheduler.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Order under the priority policy: a lower priority value first, then arrival."""
    return request.sampling_params.priority, request.arrival_time


def enqueue(waiting: deque[Request], request: Request, policy: str, preempted: bool = False) -> None:
    """Put `request` into the waiting queue. Under priority it goes after every request that
    comes before it, found from the back (where a new request of a common priority belongs)."""
    if policy == "priority":
        key, i = priority_key(request), len(waiting)
        while i > 0 and priority_key(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, request)
    elif preempted:
        waiting.appendleft(request)
    else:
        waiting.append(request)


def choose_victim(running: list[Request], policy: str) -> Request:
    """The running request to preempt: the newest (fcfs; the end of the admission-ordered list)
    or the last in priority order (priority; among equals the newest)."""
    if policy == "priority":
        return max(reversed(running), key=priority_key)
    return running[-1]
