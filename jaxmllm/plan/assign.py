"""Assignment strategies of the balancer: where the samples a microbatch selected go.

- `JointAssignment` (`balanced`): whole samples to devices (vector bin packing over the
  phases), then a row on that device; images and clips are encoded on their text's device.
- `RoutedAssignment` (`orchestrated`): every phase packed on its own (`pack_phase`: LLM samples
  to rows, images and clips to devices, anywhere: the routing tables bring encoder output rows
  to their text), then exchanges that bring items home (`localize`, `keep_capacity`) and the
  route capacity (`Routes`).

Each strategy owns its start-up checks (what the data must fit).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxmllm.config.phases import ENCODERS, LLM
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import (
    Capacities,
    OversizeError,
    check_fits,
    check_tiles_fit,
    llm_row_key,
)
from jaxmllm.plan.pack import pack_phase
from jaxmllm.plan.route import keep_capacity, localize
from jaxmllm.plan.summary import summary_of
from jaxmllm.plan.work import ENC, Micro, Phases, Pool

LATE_FITS = 64  # most samples the joint packing's rounds missed that it tries one by one

# per encoder phase: (owner position in the samples, item number, size, quadratic cost) of the
# samples' items
Items = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


class Assignment(Protocol):
    """How a microbatch's selected samples are placed on its buckets."""

    routed: bool  # whether encoder items may be encoded away from their text's device

    def check(self, index: LengthsIndex, caps: Capacities) -> None:
        """Raises OversizeError, naming the config key to change, if the data cannot fit."""
        ...

    def samples(self, ph: Phases, mb: Micro, s: Pool, urgent: np.ndarray) -> np.ndarray:
        """Places the LLM part of samples (their work `s`): each one's row bin (device * rows
        + row), -1 where it did not fit; adds them to `mb`'s loads."""
        ...

    def items(
        self,
        ph: Phases,
        mb: Micro,
        rows: np.ndarray,
        items: Items,
        urgent: np.ndarray,
        ok: np.ndarray,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Places the encoder items of the samples placed at `rows`: (the samples all of whose
        parts are placed, per phase each item's device, -1 where not placed). `ok` (the
        samples placed so far) may be updated in place."""
        ...


class JointAssignment:
    """Whole samples to devices: a sample's text and media share a device (no routing)."""

    routed = False

    def check(self, index: LengthsIndex, caps: Capacities) -> None:
        if caps.context > 1:
            raise ValueError(
                "balanced places whole samples on a device: it plans no context groups "
                "(mesh.context > 1 takes batch.planner: orchestrated)"
            )
        check_fits(index, caps)

    def samples(self, ph: Phases, mb: Micro, s: Pool, urgent: np.ndarray) -> np.ndarray:
        """Vector bin packing: in rounds of one sample per device, the biggest samples (urgent
        first, then by their largest share of a bucket) to the devices least full in their
        fullest phase, each in the device's emptiest row; then up to LATE_FITS of those that
        missed, one by one, to the device where they fit tightest."""
        caps = ph.caps
        d_n, r_n, row_len = caps.devices, caps.llm_rows, caps.llm_row_len
        w = s.work
        cap = ph.cap_vec
        norm = np.where(cap > 0, w / np.maximum(cap, 1), 0).max(1)
        order = np.lexsort((-norm, ~urgent))
        out = np.full(len(s.llm), -1, np.int64)
        rows2 = mb.rows.units.reshape(d_n, r_n)
        enc = np.stack([mb.enc[p].units for p in ENC], 1)  # [D, encoder phases] (written back)
        for start in range(0, len(s.llm), d_n):
            idx = order[start : start + d_n]
            dev_load = np.concatenate([rows2.sum(1, keepdims=True), enc], 1)
            score = (dev_load / np.maximum(cap, 1)).max(1)
            devs = np.argsort(score, kind="stable")[: len(idx)]
            r = np.argmin(rows2[devs], 1)
            ok = (rows2[devs, r] + w[idx, 0] <= row_len) & (enc[devs] + w[idx, 1:] <= cap[1:]).all(
                1
            )
            devs, r, idx = devs[ok], r[ok], idx[ok]
            rows2[devs, r] += w[idx, 0]
            enc[devs] += w[idx, 1:]
            out[idx] = devs * r_n + r
        missed = order[out[order] < 0]
        for i in missed[:LATE_FITS]:
            fits_enc = (enc + w[i, 1:] <= cap[1:]).all(1)
            r = np.argmin(rows2, 1)
            fits = fits_enc & (rows2[np.arange(d_n), r] + w[i, 0] <= row_len)
            if not fits.any():
                continue
            slack = (cap[1:] - enc).sum(1) + (row_len - rows2[np.arange(d_n), r])
            d = int(np.argmin(np.where(fits, slack, np.iinfo(np.int64).max)))
            rows2[d, r[d]] += w[i, 0]
            enc[d] += w[i, 1:]
            out[i] = d * r_n + r[d]
        for j, p in enumerate(ENC):
            mb.enc[p].units[:] = enc[:, j]
        return out

    def items(self, ph, mb, rows, items, urgent, ok):
        """Media sit on their text's device (already counted in the loads)."""
        devs = {}
        for p in ENC:
            owner = items[p][0]
            devs[p] = np.where(rows[owner] >= 0, rows[owner] // ph.caps.llm_rows, -1)
        return ok, devs


class RoutedAssignment:
    """Per phase with routing: images and clips may be encoded away from their text."""

    routed = True

    def check(self, index: LengthsIndex, caps: Capacities) -> None:
        """Items, not whole samples, must fit (a sample's items may sit on several devices),
        and the route capacity must carry the largest item's encoder rows."""
        if caps.route_pair_capacity <= 0:
            raise OversizeError(
                "batch.planner=orchestrated routes encoder outputs between "
                "devices: set batch.route_pair_capacity > 0 (e.g. the largest "
                "item's encoder rows)"
            )
        summary = summary_of(index, caps.per_token)
        most = summary.most  # (the largest document per phase)
        # (a row holds a sample whole: a preference pair's two documents)
        checks = [(llm_row_key(caps), summary.most_units[LLM], caps.group_row_len)]
        for p in ENCODERS:
            n, cap, per = len(index.items[p.name]), caps.units[p.name], caps.per_token[p.name]
            if n and not cap:
                raise OversizeError(
                    f"the data has {p.items} but model.{p.name}.enabled is false: enable it, "
                    f"or use data without {p.items}"
                )
            checks.append((f"batch.{p.capacity}", most[p.name], cap))
            if n and most[p.name] // per > caps.route_pair_capacity:
                raise OversizeError(
                    f"an item needs {most[p.name] // per} encoder rows, more than "
                    f"batch.route_pair_capacity={caps.route_pair_capacity}; raise it"
                )
        for key, need, cap in checks:
            if need > cap:
                raise OversizeError(
                    f"an item needs more than {key}={cap} (the largest needs {need}); raise {key}"
                )
        check_tiles_fit(index, caps)

    def samples(self, ph: Phases, mb: Micro, s: Pool, urgent: np.ndarray) -> np.ndarray:
        """The LLM phase on its own: samples to rows (bins of llm_row_len, or of a context
        group's rows)."""
        rows, _ = pack_phase(s.llm, mb.rows, ph.caps.group_row_len, urgent, costs=s.llm_cost)
        return rows

    def items(self, ph, mb, rows, items, urgent, ok):
        """Each encoder phase on its own, then exchanges towards the text's device."""
        devs, groups = {}, {}
        home_all = text_home(rows, ph.caps)
        for p in ENC:
            owner, _, size, cost = items[p]
            dev = np.full(len(owner), -1, np.int64)
            group = np.full(len(owner), -1, np.int64)
            sel = np.flatnonzero(ok[owner])
            dev[sel], group[sel] = pack_phase(
                size[sel],
                mb.enc[p],
                ph.cap[p],
                urgent[owner[sel]],
                home_all[owner[sel]],
                near(ph.caps),
                cost[sel],
            )
            ok[owner[sel[dev[sel] < 0]]] = False
            devs[p], groups[p] = dev, group
        for p in ENC:  # locality, then the route capacity, on the items that stay
            owner, _, size, cost = items[p]
            dev = devs[p]
            keep = np.flatnonzero(ok[owner])
            home = home_all[owner[keep]]
            old = dev[keep]
            group = groups[p][keep]
            new = localize(group, old, home, ph.caps.devices, near(ph.caps))
            dev[keep] = keep_capacity(group, new, old, size[keep], mb.enc[p], ph.cap[p], cost[keep])
            over = mb.routes[p].overflow(size[keep], dev[keep], home)
            ok[owner[keep[over]]] = False
        return ok, devs  # (the balancer counts the routed rows of what it finally keeps)


def text_home(rows: np.ndarray, caps: Capacities) -> np.ndarray:
    """Per sample placed at LLM row bin `rows` (-1: not placed), the device its items would
    rather be encoded on: its text's; with context groups a device of its text's group, spread
    over them by position (its placeholder tokens may be dealt to any of them)."""
    bucket = rows // caps.llm_rows
    if caps.context > 1:
        bucket = bucket * caps.context + np.arange(len(rows)) % caps.context
    return np.where(rows >= 0, bucket, -1)


def near(caps: Capacities) -> int:
    """The devices an item not at home prefers next (routing's `per_host`): its home's host,
    or with context groups its home's group (an item there needs no exchange at all; the
    groups lie within a host)."""
    return caps.context if caps.context > 1 else caps.devices_per_host
