# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled scheduler: the decisions of reference.py, in C data structures.

reference.py is the specification; every method here mirrors its namesake there,
expression for expression, so that both produce bit-identical floats (keep them in step;
the property tests compare the two). Requests live in a C array indexed by a handle; heap
entries refer to handles and pin them: a handle returns to the free list only once no
entry refers to it, so a tie broken by request id always reads the id it was made for. The
admission-order FIFOs of the tail cut hold (handle, generation) tickets instead, which need
no pin.
"""

from dataclasses import fields, replace

from libc.math cimport INFINITY, ceil
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memmove
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

from common.pools import POOLS
from sched_core._fast cimport Meter, meter_add, meter_rate, new_instance, put, slot, slot_offset
from sched_core._idtable cimport IdTable, idt_find, idt_free, idt_init, idt_insert, idt_remove
from sched_core._heap cimport (
    Entry, Heap, entry_lt, heap_free, heap_pop, heap_push, heap_replace_top
)

from sched_core.costmodel import COEFFICIENTS, StepModel
from sched_core.report import queued_explanation, route_reason, snapshot_dict, thresholds
from sched_core.smdp import N_STATES as _N_STATES
from sched_core.smdp import describe, in_force, long_bucket
from sched_core.types import HOLD_SLACK as _HOLD_SLACK
from sched_core.types import LN100 as _LN100
from sched_core.types import RESCUE_AFTER as _RESCUE_AFTER
from sched_core.types import Contract, Dispatch, Reject, Request, SchedulerConfig

IMPLEMENTATION = "cython"

cdef double LN100 = _LN100
cdef double HOLD_SLACK = _HOLD_SLACK
cdef double RESCUE_AFTER = _RESCUE_AFTER
cdef double INF = INFINITY


cdef Py_ssize_t* _field_offsets(type cls) except NULL:
    """Slot offsets of a dataclass's fields, in field order (kept for the module's life)."""
    names = [f.name for f in fields(cls)]
    cdef Py_ssize_t* offsets = <Py_ssize_t*>malloc(len(names) * sizeof(Py_ssize_t))
    if offsets == NULL:
        raise MemoryError()
    for i, name in enumerate(names):
        offsets[i] = slot_offset(cls, name)
    return offsets


cdef Py_ssize_t* _CONTRACT = _field_offsets(Contract)
cdef Py_ssize_t* _DISPATCH = _field_offsets(Dispatch)
cdef Py_ssize_t* _REJECT = _field_offsets(Reject)
cdef Py_ssize_t* _REQUEST = _field_offsets(Request)


cdef object _contract(str rid, int bucket, int path, double ttft, double total, double p99,
                      long long ahead, double budget_wait, double tpot, int out, double ttft_p99,
                      double tpot_p99):
    cdef object c = new_instance(Contract)
    put(c, _CONTRACT[0], rid)
    put(c, _CONTRACT[1], bucket)
    put(c, _CONTRACT[2], POOLS[path])
    put(c, _CONTRACT[3], ttft)
    put(c, _CONTRACT[4], total)
    put(c, _CONTRACT[5], p99)
    put(c, _CONTRACT[6], ahead)
    put(c, _CONTRACT[7], budget_wait)
    put(c, _CONTRACT[8], tpot)
    put(c, _CONTRACT[9], out)
    put(c, _CONTRACT[10], ttft_p99)
    put(c, _CONTRACT[11], tpot_p99)
    put(c, _CONTRACT[12], 0)  # the raw model assumes no output bound: the driver's calibration sets it
    return c


cdef object _reject(str rid, str reason, str message, double retry_after, double estimate):
    cdef object r = new_instance(Reject)
    put(r, _REJECT[0], rid)
    put(r, _REJECT[1], reason)
    put(r, _REJECT[2], message)
    put(r, _REJECT[3], retry_after)
    put(r, _REJECT[4], estimate)
    put(r, _REJECT[5], 0.0)
    put(r, _REJECT[6], 0.0)
    return r

# Request fields, in the order of types.Request.
cdef enum:
    R_ID, R_TENANT, R_WEIGHT, R_PROMPT, R_MAX_TOKENS, R_ARRIVAL, R_EXPECTED, R_PRIORITY,
    R_DEADLINE, R_BUDGET_WAIT
assert [f.name for f in fields(Request)][:10] == [
    "id", "tenant", "weight", "prompt_tokens", "max_tokens", "arrival",
    "expected_output_tokens", "priority", "deadline", "budget_wait"]
assert [f.name for f in fields(Contract)][8:] == [
    "tpot_s", "output_tokens", "ttft_p99_s", "tpot_p99_s", "output_tokens_hi"]
assert [f.name for f in fields(Reject)][5:] == ["ttft_p99_s", "p99_s"]

cdef enum:
    CPU = 0
    GPU = 1

cdef enum:
    QUEUED = 0
    INFLIGHT = 1
    DONE = 2
    FREE = 3


cdef struct Req:
    # What tick and the heaps touch, within one cache line; the rest lives in Cold.
    int state
    int pins            # heap entries that refer to this handle
    unsigned int gen    # bumped each time the handle is reused
    int tenant
    int bucket
    int prompt
    int out             # expected output tokens
    double t_in         # arrival + budget_wait
    double weight
    Py_hash_t hash      # of the id, for the id table


cdef struct Cold:
    double key          # aging key, smaller first
    double budget_wait
    double service      # predicted prefill + decode at admission
    double deadline
    long long batch     # while dispatched: its batch id


cdef struct Fifo:
    # Tickets in admission order; [head, tail) is live, stale tickets are skipped lazily.
    Entry* a            # h: handle, v: its generation when admitted
    Py_ssize_t head
    Py_ssize_t tail
    Py_ssize_t cap


cdef struct FM:
    double f            # launch cost F
    double m            # marginal cost m: S(B) = F + m·B


cdef struct Tail:
    double t_cut
    double gap


cdef enum:
    NSTATES = 12  # sched_core.smdp.N_STATES, checked at import
assert _N_STATES == NSTATES


cdef struct Act:
    # One macro-state's action (sched_core.smdp.Action), as the core applies it.
    double queue_steps
    double share
    double key_w
    double admit_w
    double admit_slack


cdef struct Terms:
    int path
    double wait
    double prefill
    double decode
    double decode_hi
    double tail


cdef void* _zalloc(size_t count, size_t size) except NULL:
    cdef void* p = calloc(count, size)
    if p == NULL:
        raise MemoryError()
    return p


cdef void* _grow(void* p, size_t size) except NULL:
    cdef void* q = realloc(p, size)
    if q == NULL:
        raise MemoryError()
    return q


cdef inline long long lmin(long long a, long long b) noexcept nogil:
    return a if a < b else b


cdef struct Rank:
    # A bucket's place in a tick's order: by (p, s), then bucket index.
    double p
    double s
    int k


cdef inline bint rank_lt(const Rank* x, const Rank* y) noexcept nogil:
    if x.p != y.p:
        return x.p < y.p
    if x.s != y.s:
        return x.s < y.s
    return x.k < y.k


cdef void sort_small(Rank* a, int n) noexcept nogil:
    """Insertion sort: a handful of buckets per tick."""
    cdef int i, j
    cdef Rank e
    for i in range(1, n):
        e = a[i]
        j = i - 1
        while j >= 0 and rank_lt(&e, &a[j]):
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = e


cdef class _Batch:
    cdef int path
    cdef double end     # dispatch time + predicted batch time
    cdef int n
    cdef int open       # requests not yet finished
    cdef int* h         # their handles; -1 once finished

    def __dealloc__(self):
        free(self.h)


cdef class Scheduler:
    """Token-budget scheduler: events in, decisions out; time is always an argument."""

    cdef readonly object config
    cdef tuple _models
    cdef int nb
    cdef int* bounds
    cdef double coef[2][5]
    cdef double quad[2]         # prefill_attention: s per squared prompt token
    cdef long long maxb[2]
    cdef long long cap[2]
    cdef long long used[2]      # sequences dispatched and not finished
    cdef long long kv[2]        # KV tokens they hold, mid-life: prompt + half the expected output
    cdef long long workers[2]
    cdef long long budget[2]    # tokens per worker step
    cdef double pend[2]         # prompt tokens dispatched and not yet seen prefilled
    cdef double queue_steps     # prefill_queue_steps of the action in force
    cdef Act acts[NSTATES]      # the policy table (sched_core.smdp), the heuristic's if none
    cdef readonly object table
    cdef int state              # the macro-state of the last arrival or tick
    cdef long long visits[NSTATES]
    cdef int long_k             # the first bucket of long prompts
    cdef double full_share
    cdef double share           # slot_share of the action in force
    cdef double key_w           # weight of a prompt token in the aging key
    cdef long long lim[2]       # slots in use allowed: the share of cap, at least one of a path's
    cdef double now
    cdef long long next_batch
    cdef long long nqueued
    cdef long long max_queued
    cdef IdTable by_id          # id → handle, for queued and running requests
    cdef dict inflight
    cdef list ids
    # requests by handle
    cdef Req* reqs
    cdef Cold* cold
    cdef double* arr            # arrival by handle: the heaps' tie-break after the key
    cdef int* tenant_of         # tenant by handle, read on heads entries without the Req
    cdef int nreqs
    cdef int reqcap
    cdef int* freelist
    cdef int nfree
    # per bucket
    cdef long long* n
    cdef long long* tok
    cdef long long* psum
    cdef long long* osum
    cdef Meter* arrivals
    cdef Fifo* fifo
    cdef Heap* heads
    cdef double* est_bucket
    # global
    cdef Meter cpu_meter
    cdef double mix_prompt
    cdef double mix_out
    cdef Heap deadlines
    cdef Heap active
    cdef double idle_floor
    # per tenant, and per (tenant, bucket) at [t * nb + k]
    cdef dict tenant_ix
    cdef list tenant_names
    cdef int ntenants
    cdef int tcap
    cdef double* counter
    cdef double* weight        # budget of the tenant's latest request
    cdef long long* backlog
    cdef unsigned int* tver
    cdef double* est
    cdef Heap* rq
    cdef unsigned int* kver
    # scratch: the batch being formed, entries set aside, buckets to sort
    cdef int* buf
    cdef int nbuf
    cdef Entry* aside
    cdef int naside
    cdef int asidecap
    cdef Rank* sortbuf
    # config
    cdef double aging
    cdef double prio_tokens
    cdef double w_in
    cdef double w_out
    cdef double slack_tokens
    cdef double tau
    cdef double alpha
    cdef double slo
    cdef double tpot
    cdef int default_out

    def __init__(self, config=None):
        if self.bounds != NULL:
            raise RuntimeError("Scheduler.__init__ called twice")
        cfg = config if config is not None else SchedulerConfig()
        self.config = cfg
        bounds = cfg.bucket_bounds
        cdef int nb = len(bounds)
        cdef int k
        self.nb = nb
        self.bounds = <int*>_zalloc(nb, sizeof(int))
        for k in range(nb):
            self.bounds[k] = bounds[k]
        self._models = (StepModel(cfg.cpu, cfg), StepModel(cfg.gpu, cfg))
        self._load_coef(CPU)
        self._load_coef(GPU)
        self.maxb[CPU] = cfg.cpu.max_batch
        self.maxb[GPU] = cfg.gpu.max_batch
        self.workers[CPU] = 1
        self.workers[GPU] = 1
        self.budget[CPU] = cfg.cpu.step_tokens
        self.budget[GPU] = cfg.gpu.step_tokens
        self.next_batch = 1
        self.max_queued = cfg.max_queued
        idt_init(&self.by_id, 1024)
        self.inflight = {}
        self.ids = []
        self.n = <long long*>_zalloc(nb, sizeof(long long))
        self.tok = <long long*>_zalloc(nb, sizeof(long long))
        self.psum = <long long*>_zalloc(nb, sizeof(long long))
        self.osum = <long long*>_zalloc(nb, sizeof(long long))
        self.arrivals = <Meter*>_zalloc(nb, sizeof(Meter))
        self.fifo = <Fifo*>_zalloc(nb, sizeof(Fifo))
        self.heads = <Heap*>_zalloc(nb, sizeof(Heap))
        self.est_bucket = <double*>_zalloc(nb, sizeof(double))
        for k in range(nb):
            self.est_bucket[k] = -1.0
        self.mix_prompt = self.bounds[0]
        self.mix_out = cfg.default_output_tokens
        self.tenant_ix = {}
        self.tenant_names = []
        self.buf = <int*>_zalloc(max(self.maxb[CPU], self.maxb[GPU]), sizeof(int))
        self.sortbuf = <Rank*>_zalloc(nb, sizeof(Rank))
        self.aging = cfg.aging_tokens_per_s
        self.prio_tokens = cfg.priority_tokens
        self.w_in = cfg.fair_input_weight
        self.w_out = cfg.fair_output_weight
        self.slack_tokens = cfg.fair_slack_tokens
        self.tau = cfg.rate_window_s
        self.alpha = cfg.ewma_alpha
        self.slo = cfg.ttft_p99_slo_s
        self.tpot = cfg.tpot_slo_s
        self._load_table(in_force(cfg.policy_table, cfg.prefill_queue_steps))
        self.queue_steps = self.acts[0].queue_steps
        self.share = self.acts[0].share
        self.key_w = self.acts[0].key_w
        self.pend[CPU] = 0.0
        self.pend[GPU] = 0.0
        self.default_out = cfg.default_output_tokens

    def __dealloc__(self):
        cdef int i
        for i in range(self.ntenants * self.nb):
            heap_free(&self.rq[i])
        for i in range(self.nb if self.heads != NULL else 0):
            heap_free(&self.heads[i])
            free(self.fifo[i].a)
        idt_free(&self.by_id)
        heap_free(&self.deadlines)
        heap_free(&self.active)
        free(self.bounds); free(self.reqs); free(self.cold); free(self.arr); free(self.tenant_of); free(self.freelist)
        free(self.n); free(self.tok); free(self.psum); free(self.osum)
        free(self.arrivals); free(self.fifo); free(self.heads); free(self.est_bucket)
        free(self.counter); free(self.weight); free(self.backlog); free(self.tver); free(self.est)
        free(self.rq); free(self.kver)
        free(self.buf); free(self.aside); free(self.sortbuf)

    # ----------------------------------------------------------------- public API

    @property
    def queued(self):
        return self.nqueued

    def __len__(self):
        return self.nqueued

    def arrive(self, req, double now):
        """Admit ``req`` with a latency contract, or reject it at once."""
        if not isinstance(req, Request):
            raise TypeError(f"arrive() takes a Request, not {type(req).__name__}")
        self.now = now
        cdef str rid = slot(req, _REQUEST[R_ID])
        cdef Py_hash_t hv = hash(rid)
        if idt_find(&self.by_id, hv, rid, self.ids) >= 0:
            return _reject(rid, "duplicate",
                         f"request {rid!r} is already queued or running", 0.0, 0.0)
        cdef int prompt = slot(req, _REQUEST[R_PROMPT])
        cdef int k = self._bucket(prompt)
        if k == self.nb:
            return _reject(rid, "too_long", f"prompt of {prompt} tokens "
                         f"exceeds the largest bucket ({self.bounds[self.nb - 1]})", 0.0, 0.0)
        self._apply(self._classify())
        cdef int t = self._tenant(slot(req, _REQUEST[R_TENANT]))
        cdef int out = self._expected_output(slot(req, _REQUEST[R_EXPECTED]),
                                             slot(req, _REQUEST[R_MAX_TOKENS]), t, k)
        cdef long long n = self.n[k] + 1
        cdef long long ahead = 0, ahead_n = 0, ahead_prompt = 0
        cdef int j
        for j in range(k + 1):  # shortest prompt first: shorter buckets go before it
            ahead += self.tok[j]
            ahead_n += self.n[j]
            ahead_prompt += self.psum[j]
        cdef Terms tm = self._terms(k, n, <double>(self.osum[k] + out) / <double>n,
                                    <double>(self.psum[k] + prompt) / <double>n, ahead_n,
                                    ahead_prompt, out, prompt, now)
        cdef double bw = slot(req, _REQUEST[R_BUDGET_WAIT])
        cdef double ttft = bw + tm.wait + tm.prefill
        cdef double total = ttft + tm.decode
        if self.nqueued >= self.max_queued:
            return _reject(rid, "queue_full",
                         f"{self.nqueued} requests queued, the limit", tm.wait, total)
        cdef double arrival = slot(req, _REQUEST[R_ARRIVAL])
        deadline = slot(req, _REQUEST[R_DEADLINE])
        if deadline is not None and arrival + total > <double>deadline:
            return _reject(rid, "deadline", f"estimated completion {total:.3f}s "
                         f"after arrival misses the deadline by "
                         f"{arrival + total - <double>deadline:.3f}s", tm.wait, total)
        self._enqueue(rid, hv, t, k, prompt, out, slot(req, _REQUEST[R_WEIGHT]), arrival, bw,
                      slot(req, _REQUEST[R_PRIORITY]), deadline, tm.prefill + tm.decode, now)
        return _contract(rid, k, tm.path, ttft, total, bw + tm.tail + tm.decode_hi, ahead, bw,
                         tm.decode / out, out, bw + tm.tail, tm.decode_hi / out)

    def tick(self, double now):
        """Decide what to do now: expired deadlines, tail cuts, then batches by urgency."""
        self.now = now
        cdef list out = []
        cdef int i, k, p, count
        cdef long long limit
        cdef int state = self._classify()
        self.visits[state] += 1
        self._apply(state)
        self._expire(now, out)
        cdef Tail tl = self._tail(now)
        if tl.t_cut < INF and self.cap[GPU] > 0:  # the cut moves the gpu queue's tail to the cpu
            self._tail_cut(now, tl.t_cut, out)
        self._rescue(now, tl.t_cut, out)
        count = self._bucket_order()
        for i in range(count):
            k = self.sortbuf[i].k
            while self.n[k] > 0:
                p = self._plan(k, now, tl.t_cut)
                if p < 0:
                    break
                limit = lmin(lmin(lmin(self.n[k], self._free(p)), self.maxb[p]), self._room(p, k))
                self._take(k, limit)
                if self.nbuf == 0:
                    break
                self._dispatch(p, k, now, out)
        return out

    def finished(self, request_id, long long output_tokens, double now):
        """One dispatched request finished with ``output_tokens``: its slot comes back now,
        not when its whole batch ends. False if it is not running (unknown, or its batch
        already reported)."""
        self.now = now
        cdef int h = self._find(request_id)
        if h < 0 or self.reqs[h].state != INFLIGHT:
            return False
        cdef long long bid = self.cold[h].batch
        cdef _Batch batch = <_Batch>self.inflight[bid]
        cdef int i
        for i in range(batch.n):
            if batch.h[i] == h:
                batch.h[i] = -1
        self._finish(h, batch.path, output_tokens)
        batch.open -= 1
        if batch.open == 0:
            del self.inflight[bid]
        return True

    def completed(self, timings, double now):
        """A batch ended: the slots of its requests not yet ``finished`` come back, and their
        output lengths are learnt (a failed batch reports none)."""
        self.now = now
        found = self.inflight.pop(timings.batch_id, None)
        if found is None:
            return
        cdef _Batch batch = <_Batch>found
        cdef int i, h
        outs = timings.output_tokens
        cdef bint exact = len(outs) == batch.n
        for i in range(batch.n):
            h = batch.h[i]
            if h >= 0:
                batch.h[i] = -1
                self._finish(h, batch.path, outs[i] if exact else -1)

    def set_table(self, table):
        """The SMDP table in force from now on (reference.py says what changes and what not)."""
        self.config = replace(self.config, policy_table=table)
        self._load_table(table)
        self._apply(self.state)
        self._limits()

    def _load_table(self, table):
        self.table = table
        for k, action in enumerate(table.actions):
            self.acts[k].queue_steps = action.prefill_queue_steps
            self.acts[k].share = action.slot_share
            self.acts[k].key_w = action.key_weight
            self.acts[k].admit_w = action.admit_weight
            self.acts[k].admit_slack = action.admit_slack
        self.full_share = table.full_share
        self.long_k = long_bucket(self.config.bucket_bounds, table.long_prompt)

    def set_prior(self, path, prior, trust=1.0):
        """``path``'s step-time model now starts from ``prior`` (its workers' measured
        profiles), held as firmly as ``trust``; what it fitted stays (``StepModel.reprior``)."""
        cdef int p = POOLS.index(path)
        self._models[p].reprior(prior, trust)
        self._load_coef(p)

    def observe_steps(self, path, records, double now):
        """Refit ``path``'s step-time model from worker step records
        ``(prefill tokens, decode sequences, KV tokens, seconds)``."""
        self.now = now
        cdef int p = POOLS.index(path)
        self._models[p].observe_many(records)
        self._load_coef(p)
        cdef double done = 0.0
        for rec in records:
            done += rec[0]
        self.pend[p] = self.pend[p] - done if self.pend[p] > done else 0.0

    def worker_capacity(self, path, slots, double now, workers=1, step_tokens=0):
        """``path``'s live workers, ``workers`` of them, offer ``slots`` sequence slots in all
        (in use ones included); ``step_tokens`` > 0 is their per-step token budget."""
        if path not in POOLS or slots < 0 or workers < 0 or step_tokens < 0:
            raise ValueError(f"unknown path {path!r}, or negative slots, workers or step tokens")
        self.now = now
        cdef int p = POOLS.index(path)
        self.cap[p] = slots
        self._limits()
        self.workers[p] = workers if workers > 0 else 1
        if step_tokens > 0:
            self.budget[p] = step_tokens

    def cancel(self, request_id, double now):
        """Remove a queued request; False if it is unknown, running or already gone."""
        self.now = now
        cdef int h = self._find(request_id)
        if h < 0 or self.reqs[h].state != QUEUED:
            return False
        self._unqueue(h, DONE)
        return True

    def snapshot(self):
        """Queues per bucket, fitted cost curves, thresholds and counters, as JSON data."""
        cdef double now = self.now
        cdef int k, p, t
        cdef FM fc, fg
        cdef Tail tl = self._tail(now)
        buckets = []
        cdef double u, kv
        for k in range(self.nb):
            n = self.n[k]
            nbar = self.osum[k] / <double>n if n else self.mix_out
            fc = self._fm(CPU, k, nbar)
            fg = self._fm(GPU, k, nbar)
            buckets.append({
                "bucket": k, "max_prompt": self.bounds[k], "queued": n, "tokens": self.tok[k],
                "arrival_rate": meter_rate(&self.arrivals[k], now, self.tau), "mean_output": nbar,
                **thresholds((fc.f, fc.m), (fg.f, fg.m), self._b2(GPU, k, nbar)),
            })
        paths = []
        for p in range(2):
            u = <double>self.used[p] / <double>self.workers[p]
            kv = <double>self.kv[p] / <double>self.workers[p]
            paths.append({
                "capacity": self.cap[p], "in_flight": self.used[p], "kv_tokens": self.kv[p],
                "workers": self.workers[p], "step_tokens": self.budget[p],
                "pending_prefill": self.pend[p],
                "slot_limit": self.lim[p],
                "max_batch": self.maxb[p], "fitted_steps": self._models[p].observations,
                "step_model": {**dict(zip(COEFFICIENTS, [self.coef[p][i] for i in range(5)],
                                          strict=True)), "prefill_attention": self.quad[p]},
                "drift": self._models[p].scale,
                "step_s": self._step_s(p, 0.0, u, kv),
            })
        tenants = {
            self.tenant_names[t]: {"counter": self.counter[t], "queued": self.backlog[t]}
            for t in range(self.ntenants)
        }
        return snapshot_dict(
            now=now, queued=self.nqueued, buckets=buckets, paths=paths, t_cut=tl.t_cut,
            mu_cpu=self._mu_cpu(), lambda_cpu=meter_rate(&self.cpu_meter, now, self.tau),
            slo=self.slo, tenants=tenants, min_counter=self._min_counter(),
            policy=describe(self.config.policy_table, self.state, self.state_visits()))

    @property
    def macro_state(self):
        """The macro-state of the last arrival or tick (``sched_core.smdp.STATE_NAMES``)."""
        return self.state

    def state_visits(self):
        """How many ticks found the scheduler in each macro-state."""
        return [self.visits[k] for k in range(NSTATES)]

    def admission(self):
        """The admission threshold of the state of the last arrival (reference.py says how
        it is read)."""
        return self.acts[self.state].admit_w, self.acts[self.state].admit_slack

    def drift(self, path):
        """How much slower than its prior ``path``'s workers run now (reference.py)."""
        return self._models[POOLS.index(path)].scale

    def prefill_alone_s(self, path, int prompt_tokens):
        """The fitted time to prefill ``prompt_tokens`` on an idle worker of ``path``: the part
        of a first token that no queue adds."""
        cdef int p = POOLS.index(path)
        return (self.coef[p][3] + self.coef[p][4] * prompt_tokens
                + self.quad[p] * <double>prompt_tokens * <double>prompt_tokens)

    def explain(self, request_id):
        """Why a request waits, what is ahead of it, where it goes; None if unknown."""
        cdef int h = self._find(request_id)
        if h < 0:
            return None
        cdef Req r = self.reqs[h]
        cdef Cold c = self.cold[h]
        cdef int k = r.bucket, t = r.tenant, i, j
        cdef Heap* heap
        cdef Entry e
        cdef _Batch batch
        if r.state == INFLIGHT:
            for bid, found in self.inflight.items():  # rare: no batch id kept per request
                batch = <_Batch>found
                for i in range(batch.n):
                    if batch.h[i] == h:
                        return {"request_id": request_id, "state": "dispatched",
                                "bucket": k, "batch_id": bid, "path": POOLS[batch.path]}
        cdef double now = self.now
        mine = (c.key, self.arr[h], request_id)
        cdef long long ahead_n = 0, ahead_tok = 0, ahead_prompt = 0
        for j in range(self.ntenants):
            heap = &self.rq[j * self.nb + k]
            for i in range(heap.n):
                e = heap.a[i]
                if self.reqs[e.h].state == QUEUED and (e.p, self.arr[e.h], self.ids[e.h]) < mine:
                    ahead_n += 1
                    ahead_tok += self.reqs[e.h].prompt + self.reqs[e.h].out
                    ahead_prompt += self.reqs[e.h].prompt
        cdef long long n = self.n[k]
        cdef double nbar = self.osum[k] / <double>n
        cdef Terms tm = self._terms(k, n, nbar, self.psum[k] / <double>n, ahead_n, ahead_prompt,
                                    r.out, r.prompt, now)
        cdef Tail tl = self._tail(now)
        cdef double lo = self._min_counter()
        path, reason = route_reason(
            target=tm.path, free=(self._free(CPU), self._free(GPU)),
            capacity=(self.cap[CPU], self.cap[GPU]), eligible=self._eligible(t),
            overdue=r.t_in + tl.t_cut <= now, holds=self._tpot_holds(tm.path, k, n, now),
            tpot_slo=self.tpot)
        cdef FM fc = self._fm(CPU, k, nbar)
        cdef FM fg = self._fm(GPU, k, nbar)
        cdef double since = c.budget_wait + (now - r.t_in)
        return queued_explanation(
            request_id=request_id, tenant=self.tenant_names[t], bucket=k,
            max_prompt=self.bounds[k], requests_ahead=ahead_n, tokens_ahead=ahead_tok,
            queued_in_bucket=n, waited_s=now - r.t_in, path=path, reason=reason,
            counter=self.counter[t], min_counter=lo, t_cut=tl.t_cut,
            limits=thresholds((fc.f, fc.m), (fg.f, fg.m), self._b2(GPU, k, nbar)),
            ttft_s=since + tm.wait + tm.prefill,
            total_s=since + tm.wait + tm.prefill + tm.decode,
            p99_s=since + tm.tail + tm.decode_hi)

    # ------------------------------------------------------------ admission

    cdef int _find(self, request_id) except -2:
        """The handle of a queued or running request, or -1."""
        if not isinstance(request_id, str):
            return -1
        return idt_find(&self.by_id, hash(request_id), request_id, self.ids)

    cdef int _load_coef(self, int p) except -1:
        cdef int i
        model = self._models[p]
        for i, value in enumerate(model.coefficients()):
            self.coef[p][i] = value
        self.quad[p] = model.attention
        return 0

    cdef int _bucket(self, int prompt) noexcept:
        """bisect_left over the bucket bounds: the first bucket whose bound is >= prompt."""
        cdef int k
        for k in range(self.nb):
            if self.bounds[k] >= prompt:
                return k
        return self.nb

    cdef int _tenant(self, name) except -1:
        found = self.tenant_ix.get(name)
        if found is not None:
            return found
        cdef int t = self.ntenants, k, i
        cdef int nb = self.nb
        if t == self.tcap:
            self.tcap = 16 if self.tcap == 0 else 2 * self.tcap
            self.counter = <double*>_grow(self.counter, self.tcap * sizeof(double))
            self.weight = <double*>_grow(self.weight, self.tcap * sizeof(double))
            self.backlog = <long long*>_grow(self.backlog, self.tcap * sizeof(long long))
            self.tver = <unsigned int*>_grow(self.tver, self.tcap * sizeof(unsigned int))
            self.est = <double*>_grow(self.est, self.tcap * nb * sizeof(double))
            self.rq = <Heap*>_grow(self.rq, self.tcap * nb * sizeof(Heap))
            self.kver = <unsigned int*>_grow(self.kver, self.tcap * nb * sizeof(unsigned int))
        self.ntenants += 1
        self.tenant_ix[name] = t
        self.tenant_names.append(name)
        self.counter[t] = 0.0
        self.weight[t] = 1.0
        self.backlog[t] = 0
        self.tver[t] = 0
        for k in range(nb):
            i = t * nb + k
            self.est[i] = -1.0
            self.rq[i].a = NULL
            self.rq[i].n = 0
            self.rq[i].cap = 0
            self.kver[i] = 0
        return t

    cdef int _expected_output(self, long long given, long long max_tokens, int t,
                              int k) noexcept:
        if given > 0:
            return lmin(given, max_tokens)
        cdef double e = self.est[t * self.nb + k]
        if e < 0.0:
            e = self.est_bucket[k]
        if e < 0.0:
            e = self.default_out
        return max(1, lmin(max_tokens, <long long>(e + 0.5)))

    cdef Terms _terms(self, int k, long long n, double nbar, double lbar, long long ahead_n,
                      long long ahead_prompt, int out, int prompt, double now) noexcept:
        cdef Terms r
        cdef int p = self._target(k, n, nbar)
        cdef long long cap = self.lim[p] if self.lim[p] > 1 else 1
        cdef long long w = self.workers[p]
        cdef long long per = cap // w if cap // w > 1 else 1
        per = lmin(self.maxb[p], per)
        cdef double length = self.bounds[k]
        cdef double s_full = (self._prefill_s(p, <double>per * length, 0.0, 0.0)
                              + nbar * self._step_s(p, 0.0, <double>per,
                                                    <double>per * (length + 0.5 * nbar)))
        cdef long long free = self._free(p)
        if free < 0:
            free = 0
        cdef double wait = 0.0
        if ahead_n >= free:
            wait = <double>(ahead_n - free + 1) * s_full / <double>(w * per)
        cdef Tail tl = self._tail(now)
        cdef double u = <double>self.used[p] / <double>w
        cdef double kv = <double>self.kv[p] / <double>w
        if self.used[p] > 0:  # the rest of the step its worker is in: half of one, on average
            wait += 0.5 * self._step_s(p, 0.0, u, kv)
        cdef double before = self.pend[p]
        if ahead_n > free:
            before += <double>ahead_prompt * <double>free / <double>ahead_n
        else:
            before += <double>ahead_prompt
        cdef long long run = lmin(n, self.maxb[p])
        r.path = p
        r.wait = wait
        # its prompt is prefilled after those before it, in the same chunked passes
        r.prefill = (self._prefill_s(p, before / <double>w + <double>prompt + <double>(run - 1) * lbar, u, kv)
                     + self.quad[p] * (<double>prompt * <double>prompt + <double>(run - 1) * lbar * lbar))
        cdef double kv_run = kv + <double>run * length
        r.decode = out * self._step_s(p, 0.0, u + run, kv_run)
        cdef double hi = u + run if u + run > per else <double>per
        cdef double kv_hi = hi * (length + out)
        r.decode_hi = out * self._step_s(p, 0.0, hi, kv_hi if kv_hi > kv_run else kv_run)
        cdef double queue = wait + r.prefill
        cdef double bound
        if tl.t_cut < INF:
            bound = tl.t_cut + LN100 / tl.gap
            r.tail = bound if bound > queue else queue
        else:
            r.tail = LN100 * queue
        return r

    cdef int _enqueue(self, str rid, Py_hash_t hv, int t, int k, int prompt, int out,
                      double weight, double arrival, double bw, long long priority, deadline,
                      double service, double now) except -1:
        cdef long long cost = prompt + out
        # shortest prompt first, with aging (docs/scheduling.md §2)
        cdef double key = prompt * self.key_w + self.aging * arrival + self.prio_tokens * priority
        cdef int h = self._new_handle(rid)
        idt_insert(&self.by_id, hv, h)
        cdef Req* r = &self.reqs[h]
        cdef Cold* c = &self.cold[h]
        cdef double floor, t_in = arrival + bw
        r.hash = hv
        self.arr[h] = arrival
        self.tenant_of[h] = t
        r.t_in = t_in
        r.weight = weight
        c.key = key
        c.budget_wait = bw
        c.service = service
        c.deadline = deadline if deadline is not None else INF
        r.prompt = prompt
        r.out = out
        r.tenant = t
        r.bucket = k
        r.state = QUEUED
        r.pins = 0
        self.weight[t] = weight
        if self.backlog[t] == 0:
            floor = self._min_counter()
            if floor == INF:
                floor = self.idle_floor
            if self.counter[t] < floor:
                self.counter[t] = floor
            self.backlog[t] = 1
            self._enter_active(t)
        else:
            self.backlog[t] += 1
        self.n[k] += 1
        self.tok[k] += cost
        self.psum[k] += prompt
        self.osum[k] += out
        self.nqueued += 1
        cdef Heap* heap = &self.rq[t * self.nb + k]
        self._push(heap, key, h, 0)
        if heap.a[0].h == h:
            self._push_head(k, t)
        self._fifo_push(k, h)
        if deadline is not None:
            self._push(&self.deadlines, <double>deadline - service, h, 0)
        meter_add(&self.arrivals[k], now, 1.0, self.tau)
        self.mix_prompt += self.alpha * (prompt - self.mix_prompt)
        self.mix_out += self.alpha * (out - self.mix_out)
        return 0

    # ------------------------------------------------------------ handles and heaps

    cdef int _new_handle(self, str rid) except -1:
        cdef int h
        if self.nfree > 0:
            self.nfree -= 1
            h = self.freelist[self.nfree]
            self.ids[h] = rid
            return h
        if self.nreqs == self.reqcap:
            self.reqcap = 1024 if self.reqcap == 0 else 2 * self.reqcap
            self.reqs = <Req*>_grow(self.reqs, self.reqcap * sizeof(Req))
            self.cold = <Cold*>_grow(self.cold, self.reqcap * sizeof(Cold))
            self.arr = <double*>_grow(self.arr, self.reqcap * sizeof(double))
            self.tenant_of = <int*>_grow(self.tenant_of, self.reqcap * sizeof(int))
            self.freelist = <int*>_grow(self.freelist, self.reqcap * sizeof(int))
        h = self.nreqs
        self.reqs[h].state = FREE
        self.reqs[h].pins = 0
        self.reqs[h].gen = 0
        self.nreqs += 1
        self.ids.append(rid)
        return h

    cdef void _maybe_release(self, int h) noexcept:
        cdef Req* r = &self.reqs[h]
        if r.state == DONE and r.pins == 0:
            r.state = FREE
            r.gen += 1
            self.ids[h] = None
            self.freelist[self.nfree] = h
            self.nfree += 1

    cdef int _push(self, Heap* hp, double p, int h, unsigned int v) except -1:
        cdef Entry e
        e.p = p
        e.h = h
        e.v = v
        self.reqs[h].pins += 1
        return heap_push(hp, e, self.arr, self.ids)

    cdef Entry _pop(self, Heap* hp) noexcept:
        cdef Entry e = heap_pop(hp, self.arr, self.ids)
        self.reqs[e.h].pins -= 1
        self._maybe_release(e.h)
        return e

    cdef int _push_head(self, int k, int t) except -1:
        """Enter the top of (k, t) in heads[k], replacing its previous entry. Where that
        entry is the top of heads[k] (the common case: _take just served it) it is replaced
        in place instead of being left to surface as a stale entry."""
        cdef int i = t * self.nb + k
        cdef Heap* heads = &self.heads[k]
        cdef int old = heads.a[0].h if heads.n > 0 else -1
        cdef bint at_top = (old >= 0 and heads.a[0].v == self.kver[i]
                            and self.tenant_of[old] == t)
        self.kver[i] += 1
        if self.rq[i].n == 0:
            if at_top:
                self._pop(heads)
            return 0
        cdef Entry e = self.rq[i].a[0]
        if not at_top:
            return self._push(heads, e.p, e.h, self.kver[i])
        e.v = self.kver[i]
        self.reqs[e.h].pins += 1
        heap_replace_top(heads, e, self.arr, self.ids)
        self.reqs[old].pins -= 1
        self._maybe_release(old)
        return 0

    cdef Entry _head(self, int k) except *:
        """The valid top of heads[k] (the bucket must not be empty)."""
        cdef Heap* heads = &self.heads[k]
        while heads.a[0].v != self.kver[self.tenant_of[heads.a[0].h] * self.nb + k]:
            self._pop(heads)
        return heads.a[0]

    cdef int _fifo_push(self, int k, int h) except -1:
        cdef Fifo* q = &self.fifo[k]
        cdef Py_ssize_t i, kept = 0
        if q.tail == q.cap:
            if q.tail - q.head > 2 * self.n[k] + 64:
                # Mostly stale: keep the tickets of requests still queued.
                for i in range(q.head, q.tail):
                    if self._ticket_live(q.a[i]):
                        q.a[kept] = q.a[i]
                        kept += 1
                q.head = 0
                q.tail = kept
            elif q.head > 0:
                memmove(q.a, q.a + q.head, (q.tail - q.head) * sizeof(Entry))
                q.tail -= q.head
                q.head = 0
            if q.tail == q.cap:
                q.cap = 64 if q.cap == 0 else 2 * q.cap
                q.a = <Entry*>_grow(q.a, q.cap * sizeof(Entry))
        q.a[q.tail].h = h
        q.a[q.tail].v = self.reqs[h].gen
        q.tail += 1
        return 0

    cdef inline bint _ticket_live(self, Entry e) noexcept:
        return self.reqs[e.h].gen == e.v and self.reqs[e.h].state == QUEUED

    cdef int _fifo_head(self, int k) noexcept:
        """The earliest admitted request still queued in bucket k, or -1."""
        cdef Fifo* q = &self.fifo[k]
        while q.head < q.tail and not self._ticket_live(q.a[q.head]):
            q.head += 1
        return q.a[q.head].h if q.head < q.tail else -1

    cdef int _aside_add(self, Entry e) except -1:
        if self.naside == self.asidecap:
            self.asidecap = 64 if self.asidecap == 0 else 2 * self.asidecap
            self.aside = <Entry*>_grow(self.aside, self.asidecap * sizeof(Entry))
        self.aside[self.naside] = e
        self.naside += 1
        return 0

    cdef int _aside_restore(self, Heap* hp) except -1:
        cdef int i
        for i in range(self.naside):
            heap_push(hp, self.aside[i], self.arr, self.ids)
        self.naside = 0
        return 0

    cdef int _aside_restore_fifo(self, int k) noexcept:
        """Put the tickets set aside back at the front of the FIFO, in their order (they were
        taken from there, so the slots before head are free)."""
        cdef Fifo* q = &self.fifo[k]
        cdef int i
        q.head -= self.naside
        for i in range(self.naside):
            q.a[q.head + i] = self.aside[i]
        self.naside = 0
        return 0

    cdef int _unqueue(self, int h, int state) except -1:
        """Take a queued request out of every count; entries in other heaps go lazily."""
        cdef Req* r = &self.reqs[h]
        cdef int k = r.bucket, t = r.tenant, i = t * self.nb + k
        if state == DONE:
            idt_remove(&self.by_id, r.hash, h)
        r.state = state
        self.n[k] -= 1
        self.tok[k] -= r.prompt + r.out
        self.psum[k] -= r.prompt
        self.osum[k] -= r.out
        self.nqueued -= 1
        cdef Heap* heap = &self.rq[i]
        if heap.a[0].h == h:
            self._pop(heap)
            while heap.n > 0 and self.reqs[heap.a[0].h].state != QUEUED:
                self._pop(heap)
            self._push_head(k, t)
        self.backlog[t] -= 1
        if self.backlog[t] == 0:
            self.tver[t] += 1
            if self._min_counter() == INF:
                self.idle_floor = self.counter[t]
        self._maybe_release(h)
        return 0

    cdef int _expire(self, double now, list out) except -1:
        """Reject queued requests that can no longer finish before their deadline."""
        cdef Entry e
        cdef double late, deadline
        while self.deadlines.n > 0 and self.deadlines.a[0].p < now:
            e = self._pop(&self.deadlines)
            if self.reqs[e.h].state != QUEUED:
                continue
            rid = self.ids[e.h]
            deadline = self.cold[e.h].deadline
            late = now - self.arr[e.h] + self.cold[e.h].service
            self._unqueue(e.h, DONE)
            out.append(_reject(rid, "deadline", f"deadline {deadline:.3f} can no "
                             f"longer be met: completion {late:.3f}s after arrival", 0.0, late))
        return 0

    # ------------------------------------------------------------ fairness

    # The heap of backlogged tenants holds one valid entry per tenant (its version), keyed
    # by a lower bound of its counter: a charge raises the counter without touching the
    # heap, and the minimum is repaired when it surfaces (lazy decrease-key, as in Dijkstra).
    # Anything that lowers a counter enters a fresh entry. The reference keeps exact keys;
    # the minimum both report is the same number.

    cdef int _enter_active(self, int t) except -1:
        cdef Entry e
        self.tver[t] += 1
        e.p = self.counter[t]
        e.h = t
        e.v = self.tver[t]
        return heap_push(&self.active, e, NULL, None)

    cdef int _most_behind(self) except -2:
        """The backlogged tenant with the smallest counter (ties: first seen), or -1."""
        cdef Entry top
        while self.active.n > 0:
            top = self.active.a[0]
            if top.v != self.tver[top.h]:
                heap_pop(&self.active, NULL, None)
            elif top.p < self.counter[top.h]:
                top.p = self.counter[top.h]
                heap_replace_top(&self.active, top, NULL, None)
            else:
                return top.h
        return -1

    cdef double _min_counter(self) except? -1.0:
        """The smallest virtual counter among backlogged tenants (inf if none)."""
        cdef int t = self._most_behind()
        return INF if t < 0 else self.counter[t]

    cdef bint _eligible(self, int t) except -1:
        cdef double slack = self.slack_tokens / self.weight[t]
        return self.counter[t] <= self._min_counter() + slack

    cdef int _serve(self, int h) except -1:
        """Charge the tenant's counter for the request's tokens; add it to the batch."""
        cdef Req* r = &self.reqs[h]
        cdef int t = r.tenant
        self.counter[t] += (self.w_in * r.prompt + self.w_out * r.out) / r.weight
        self._unqueue(h, INFLIGHT)
        self.buf[self.nbuf] = h
        self.nbuf += 1
        return 0

    cdef int _observe_output(self, int h, int produced) except -1:
        """Learn the output length; correct the counter charged with the estimate."""
        cdef Req* r = &self.reqs[h]
        cdef int t = r.tenant, k = r.bucket, i = t * self.nb + k
        if self.est[i] < 0.0:
            self.est[i] = produced
        else:
            self.est[i] = self.est[i] + self.alpha * (produced - self.est[i])
        if self.est_bucket[k] < 0.0:
            self.est_bucket[k] = produced
        else:
            self.est_bucket[k] = self.est_bucket[k] + self.alpha * (produced - self.est_bucket[k])
        cdef double correction = self.w_out * <double>(produced - r.out) / r.weight
        self.counter[t] += correction
        if self.backlog[t] > 0 and correction < 0.0:
            self._enter_active(t)
        return 0

    # ------------------------------------------------------------ release

    cdef inline long long _free(self, int p) noexcept:
        return self.lim[p] - self.used[p]

    # ------------------------------------------------------------ macro-states

    cdef inline int _classify(self) noexcept:
        """The macro-state now (sched_core.smdp.classify)."""
        cdef long long free = 0
        cdef int k, level, lng = 0, full = 0
        if self.cap[CPU] > self.used[CPU]:
            free += self.cap[CPU] - self.used[CPU]
        if self.cap[GPU] > self.used[GPU]:
            free += self.cap[GPU] - self.used[GPU]
        for k in range(self.long_k, self.nb):
            if self.n[k] > 0:
                lng = 1
                break
        if ((self.cap[CPU] > 0 and self.used[CPU] >= self.full_share * self.cap[CPU])
                or (self.cap[GPU] > 0 and self.used[GPU] >= self.full_share * self.cap[GPU])):
            full = 1
        if self.nqueued <= free:
            level = 0
        elif self.nqueued <= self.cap[CPU] + self.cap[GPU]:
            level = 1
        else:
            level = 2
        return level * 4 + lng * 2 + full

    cdef inline void _apply(self, int state) noexcept:
        """Put the state's action in force."""
        self.state = state
        cdef Act* a = &self.acts[state]
        self.queue_steps = a.queue_steps
        self.key_w = a.key_w
        if a.share != self.share:
            self.share = a.share
            self._limits()

    cdef inline void _limits(self) noexcept:
        """The slots each path may fill: its share of the capacity, at least one."""
        cdef int p
        cdef long long lim
        for p in range(2):
            lim = <long long>(<double>self.cap[p] * self.share)
            self.lim[p] = lim if lim > 0 or self.cap[p] <= 0 else 1

    cdef inline double _step_s(self, int p, double prefill, double seqs, double kv) noexcept:
        """One worker step: a decode forward of ``seqs`` sequences holding ``kv`` KV tokens
        and a prefill forward of ``prefill`` prompt tokens (either may be absent)."""
        cdef double s = 0.0
        if seqs > 0.0:
            s = self.coef[p][0] + self.coef[p][1] * seqs + self.coef[p][2] * kv
        if prefill > 0.0:
            s = s + (self.coef[p][3] + self.coef[p][4] * prefill)
        return s

    cdef inline double _chunk(self, int p, double u) noexcept:
        """Prompt tokens per step a worker running u sequences prefills."""
        cdef double budget = self.budget[p]
        cdef double c = budget - u
        return c if c > 0.25 * budget else 0.25 * budget

    cdef double _prefill_s(self, int p, double tokens, double u, double kv) noexcept:
        """Chunked prefill of ``tokens`` prompt tokens next to u running sequences."""
        if tokens <= 0.0:
            return 0.0
        if u <= 0.0:
            return self.coef[p][3] + self.coef[p][4] * tokens
        cdef double steps = ceil(tokens / self._chunk(p, u))
        return (steps * (self.coef[p][3] + (self.coef[p][0] + self.coef[p][1] * u
                                            + self.coef[p][2] * kv))
                + self.coef[p][4] * tokens)

    cdef inline FM _fm(self, int p, int k, double nbar) noexcept:
        """The batch line ``S(B) = F + m·B`` of path p for bucket k."""
        cdef FM r
        cdef double w = self.workers[p]
        cdef double u = self.used[p] / w, kv = self.kv[p] / w
        cdef double length = self.bounds[k]
        cdef double dl = self.coef[p][0], ds = self.coef[p][1], kc = self.coef[p][2]
        cdef double pl = self.coef[p][3], pt = self.coef[p][4]
        cdef double step = dl + ds * u + kc * kv
        cdef double fixed = pl + step if u > 0.0 else pl
        r.f = fixed + nbar * step
        cdef double share = fixed / self._chunk(p, u) if u > 0.0 else 0.0
        r.m = length * (share + pt) + nbar * (ds + kc * (length + 0.5 * nbar))
        return r

    cdef double _b2(self, int p, int k, double nbar) noexcept:
        """B2: the most sequences of bucket k one worker of p decodes within the TPOT SLO."""
        cdef double per = self.coef[p][1] + self.coef[p][2] * (self.bounds[k] + 0.5 * nbar)
        cdef double room = self.tpot - self.coef[p][0]
        if room <= 0.0:
            return 0.0
        return room / per if per > 0.0 else INF

    cdef int _target(self, int k, long long n, double nbar) noexcept:
        """The path that finishes n requests of bucket k sooner (n < B1 ⟺ cpu)."""
        if self.cap[GPU] <= 0:
            return CPU
        if self.cap[CPU] <= 0:
            return GPU
        cdef FM c = self._fm(CPU, k, nbar)
        cdef FM g = self._fm(GPU, k, nbar)
        return CPU if c.f + c.m * n < g.f + g.m * n else GPU

    cdef bint _tpot_holds(self, int p, int k, long long n, double now) except -1:
        """Hold bucket k's next batch off path p iff, once it decodes beside them, the running
        sequences' decode step would pass the TPOT SLO while it now meets it (the prefill
        steps in between are bounded by the step budget and spread over every output
        token), and the bucket's oldest request would still get its first token (after the
        prompts already sent to the path and its own) within ``HOLD_SLACK`` of the TTFT SLO.
        Nothing running: never held."""
        if self.used[p] <= 0:
            return False
        cdef double w = self.workers[p]
        cdef double u = self.used[p] / w, kv = self.kv[p] / w
        if self._step_s(p, 0.0, u, kv) > self.tpot:
            return False
        cdef long long r = lmin(lmin(n, self._free(p)), self.maxb[p])
        if r <= 0:
            return False
        cdef double tokens = <double>r * (<double>self.psum[k] / <double>n)
        if self._step_s(p, 0.0, u + r, kv + tokens) <= self.tpot:
            return False
        cdef int head = self._fifo_head(k)
        return head >= 0 and self._first_token_s(p, self.reqs[head].t_in, tokens, now) < HOLD_SLACK * self.slo

    cdef bint _overdue(self, int k, double now, double t_cut) except -1:
        cdef int h = self._fifo_head(k)
        return h >= 0 and self.reqs[h].t_in + t_cut <= now

    cdef bint _saturated(self, int p) noexcept:
        """Path p's workers hold ``prefill_queue_steps`` steps of prompt tokens they have not
        prefilled yet: more would only queue in their FIFO, out of the order's reach."""
        return self.used[p] > 0 and self.pend[p] >= self._queue_limit(p)

    cdef double _queue_limit(self, int p) noexcept:
        """Prompt tokens path p's workers prefill in ``prefill_queue_steps`` steps beside
        the sequences they run."""
        cdef double w = <double>self.workers[p]
        return self.queue_steps * self._chunk(p, <double>self.used[p] / w) * w

    cdef long long _room(self, int p, int k) noexcept:
        """How many of bucket k's requests (at its mean prompt) fill path p's prefill queue
        up to its limit, at least one; no limit while nothing runs there."""
        if self.used[p] <= 0:
            return self.maxb[p]
        cdef double room = self._queue_limit(p) - self.pend[p]
        cdef double mean = <double>self.psum[k] / <double>self.n[k] if self.n[k] > 0 else 0.0
        if room <= 0.0 or mean <= 0.0:
            return 1
        cdef double count = ceil(room / mean) if room / mean < <double>self.maxb[p] else <double>self.maxb[p]
        return <long long>count if count > 1.0 else 1

    cdef bint _releases(self, int p, int k, long long n, double now, double t_cut) except -1:
        """Release to p now unless its prefill queue is full, or the TPOT rule holds it and
        the bucket is not overdue (a full prefill queue holds even an overdue bucket: more
        would only wait there, in the worker's order instead of this one)."""
        if self._saturated(p):
            return False
        return self._overdue(k, now, t_cut) or not self._tpot_holds(p, k, n, now)

    cdef double _busy_for(self, int p, double now) except -1.0:
        """Predicted time until the first in-flight batch of path p finishes."""
        cdef double first = INF, left
        cdef _Batch b
        for found in self.inflight.values():
            b = <_Batch>found
            if b.path == p and b.end < first:
                first = b.end
        if first == INF:
            return 0.0
        left = first - now
        return left if left > 0.0 else 0.0

    cdef int _plan(self, int k, double now, double t_cut) except -2:
        """The path bucket k releases a batch to now, or -1 to wait."""
        cdef long long n = self.n[k]
        cdef long long fc = self._free(CPU), fg = self._free(GPU), size
        if fc <= 0 and fg <= 0:
            return -1
        cdef double nbar = self.osum[k] / <double>n
        cdef int target = self._target(k, n, nbar)
        if (fc if target == CPU else fg) > 0 and self._releases(target, k, n, now, t_cut):
            return target
        # The target is busy or holds the batch for its running sequences: the other path
        # takes it if it finishes it no later than the target would after it frees up, or
        # if only there does its oldest request still make its SLO.
        cdef int other = 1 - target
        if (fc if other == CPU else fg) <= 0:
            return -1
        size = lmin(lmin(n, self._free(other)), self.maxb[other])
        cdef FM fo = self._fm(other, k, nbar)
        cdef FM ft = self._fm(target, k, nbar)
        if (fo.f + fo.m * size > self._busy_for(target, now) + (ft.f + ft.m * size)
                and not self._rescues(other, k, n, size, now)):
            return -1
        return other if self._releases(other, k, n, now, t_cut) else -1

    cdef bint _rescues(self, int other, int k, long long n, long long size, double now) except -1:
        """The overflow that keeps a request's SLO where the target path cannot start it now:
        the other path takes the batch if bucket k's oldest request gets its first token there
        within the TTFT SLO and its decode step stays within the TPOT SLO
        (``reference.Scheduler._rescues``)."""
        cdef int head = self._fifo_head(k)
        if head < 0:
            return False
        cdef double w = self.workers[other]
        cdef double u = self.used[other] / w, kv = self.kv[other] / w
        cdef double tokens = <double>size * (<double>self.psum[k] / <double>n)
        if self._first_token_s(other, self.reqs[head].t_in, tokens, now) > self.slo:
            return False
        return self._step_s(other, 0.0, u + size, kv + tokens) <= self.tpot

    cdef int _bucket_order(self) except -1:
        """Non-empty buckets into sortbuf: first the one holding the best request of the
        most-behind tenant, then the others, most urgent head first; returns their count."""
        cdef int k, lead = -1, count = 0
        cdef int t = self._most_behind()
        cdef Entry e, best
        if t >= 0:
            for k in range(self.nb):
                if self.rq[t * self.nb + k].n > 0:
                    e = self.rq[t * self.nb + k].a[0]
                    if lead < 0 or entry_lt(&e, &best, self.arr, self.ids):
                        best = e
                        lead = k
            self.sortbuf[0].k = lead
            count = 1
        for k in range(self.nb):
            if self.n[k] > 0 and k != lead:
                e = self._head(k)
                self.sortbuf[count].p = e.p
                self.sortbuf[count].s = self.arr[e.h]
                self.sortbuf[count].k = k
                count += 1
        sort_small(self.sortbuf + (1 if lead >= 0 else 0), count - (1 if lead >= 0 else 0))
        return count

    cdef int _take(self, int k, long long limit) except -1:
        """Up to ``limit`` requests of bucket k by aging key into buf, skipping tenants that
        are more than the slack ahead of the smallest backlogged counter."""
        cdef Heap* heads = &self.heads[k]
        cdef Entry e
        cdef int t
        self.nbuf = 0
        while self.nbuf < limit and heads.n > 0:
            e = heads.a[0]
            t = self.tenant_of[e.h]
            if e.v != self.kver[t * self.nb + k]:
                self._pop(heads)
            elif not self._eligible(t):
                # Set aside for this take; it returns as it is, pin and all.
                self._aside_add(e)
                heap_pop(heads, self.arr, self.ids)
            else:
                # _unqueue replaces this entry in place by the tenant's next request.
                self._serve(self.rq[t * self.nb + k].a[0].h)
        self._aside_restore(heads)
        return 0

    cdef Tail _tail(self, double now) noexcept:
        """(T_cut, μ_a − λ_a); T_cut = SLO − ln(100)/(μ_a − λ_a), inf where not positive."""
        cdef Tail r
        cdef double mu = self._mu_cpu()
        r.t_cut = INF
        r.gap = INF
        if mu <= 0.0:
            return r
        cdef double gap = mu - meter_rate(&self.cpu_meter, now, self.tau)
        if gap * self.slo <= LN100:
            return r
        r.t_cut = self.slo - LN100 / gap
        r.gap = gap
        return r

    cdef double _mu_cpu(self) noexcept:
        """μ_a: requests/s the cpu path serves with every worker full, at the current mix."""
        cdef long long cap = self.lim[CPU]
        if cap <= 0:
            return 0.0
        cdef long long w = self.workers[CPU]
        cdef long long b = cap // w if cap // w > 1 else 1
        b = lmin(b, self.maxb[CPU])
        cdef double lp = self.mix_prompt, lo = self.mix_out
        cdef double s = (self._prefill_s(CPU, <double>b * lp, 0.0, 0.0)
                         + lo * self._step_s(CPU, 0.0, <double>b, <double>b * (lp + 0.5 * lo)))
        return <double>(w * b) / s if s > 0.0 else INF

    cdef int _late_buckets(self, double now, double wait) except -1:
        """The buckets whose oldest queued request has waited ``wait`` into sortbuf, the one
        whose oldest entered first first; returns their count."""
        cdef int k, h, count = 0
        for k in range(self.nb):
            h = self._fifo_head(k)
            if h >= 0 and self.reqs[h].t_in + wait <= now:
                self.sortbuf[count].p = self.reqs[h].t_in
                self.sortbuf[count].s = self.arr[h]
                self.sortbuf[count].k = k
                count += 1
        sort_small(self.sortbuf, count)
        return count

    cdef int _tail_cut(self, double now, double t_cut, list out) except -1:
        """Requests that waited T_cut go to the cpu path in admission order, bucket by
        bucket (the bucket whose overdue head entered first goes first)."""
        cdef int k, h, i
        cdef long long limit
        cdef Fifo* q
        cdef int count = self._late_buckets(now, t_cut)
        for i in range(count):
            k = self.sortbuf[i].k
            limit = lmin(lmin(self._free(CPU), self.maxb[CPU]), self._room(CPU, k))
            if limit <= 0 or self._saturated(CPU):
                return 0
            q = &self.fifo[k]
            self.nbuf = 0
            while self.nbuf < limit:
                h = self._fifo_head(k)
                if h < 0 or self.reqs[h].t_in + t_cut > now:
                    break
                q.head += 1
                if self._eligible(self.reqs[h].tenant):
                    self._serve(h)
                else:
                    self._aside_add(q.a[q.head - 1])
            self._aside_restore_fifo(k)
            if self.nbuf:
                self._dispatch(CPU, k, now, out)
        return 0

    cdef int _rescue(self, double now, double t_cut, list out) except -1:
        """The late go first: a bucket's oldest request that has waited ``RESCUE_AFTER`` of the
        TTFT SLO is dispatched alone, ahead of the order, where it still makes the SLO
        (``reference.Scheduler._rescue``)."""
        cdef double late = RESCUE_AFTER * self.slo
        cdef int k, h, i, p
        cdef int count = self._late_buckets(now, late)
        for i in range(count):
            k = self.sortbuf[i].k
            while True:
                h = self._fifo_head(k)
                if h < 0 or self.reqs[h].t_in + late > now:
                    break
                p = self._plan(k, now, t_cut)
                if p < 0:
                    return 0
                if (not self._eligible(self.reqs[h].tenant)
                        or self._first_token_s(p, self.reqs[h].t_in, <double>self.reqs[h].prompt, now) > self.slo):
                    break
                self.nbuf = 0
                self._serve(h)
                self._dispatch(p, k, now, out)
        return 0

    cdef double _first_token_s(self, int p, double t_in, double tokens, double now) noexcept:
        """From admission to the first token of a request admitted at ``t_in`` with ``tokens``
        prompt tokens, sent to path p now (``reference.Scheduler._first_token_s``)."""
        cdef double w = self.workers[p]
        cdef double u = self.used[p] / w, kv = self.kv[p] / w
        cdef double queue = self._prefill_s(p, self.pend[p] / w, u, kv)
        return (now - t_in) + queue + self._prefill_s(p, tokens, u, kv)

    cdef int _dispatch(self, int p, int k, double now, list out) except -1:
        cdef int size = self.nbuf, i, h
        cdef long long length = 0, steps = 0
        cdef Req* r
        for i in range(size):
            r = &self.reqs[self.buf[i]]
            if r.prompt > length:
                length = r.prompt
            if r.out > steps:
                steps = r.out
        cdef double tokens = <double>(size * length)
        cdef double w = self.workers[p]
        cdef double u = self.used[p] / w, kv = self.kv[p] / w
        cdef double predicted = (self._prefill_s(p, tokens, u, kv)
                                 + steps * self._step_s(p, 0.0, u + size, kv + tokens))
        cdef long long bid = self.next_batch
        self.next_batch += 1
        cdef _Batch batch = _Batch.__new__(_Batch)
        batch.path = p
        batch.end = now + predicted
        batch.n = size
        batch.open = size
        batch.h = <int*>malloc(size * sizeof(int))
        if batch.h == NULL:
            raise MemoryError()
        request_ids = PyTuple_New(size)
        for i in range(size):
            h = self.buf[i]
            batch.h[i] = h
            self.cold[h].batch = bid
            self.kv[p] += self.reqs[h].prompt + self.reqs[h].out / 2
            self.pend[p] += self.reqs[h].prompt
            rid = self.ids[h]
            Py_INCREF(rid)
            PyTuple_SET_ITEM(request_ids, i, rid)
        self.used[p] += size
        self.inflight[bid] = batch
        if p == CPU:
            meter_add(&self.cpu_meter, now, size, self.tau)
        cdef object d = new_instance(Dispatch)
        put(d, _DISPATCH[0], bid)
        put(d, _DISPATCH[1], POOLS[p])
        put(d, _DISPATCH[2], k)
        put(d, _DISPATCH[3], request_ids)
        put(d, _DISPATCH[4], predicted)
        out.append(d)
        return 0

    cdef int _finish(self, int h, int p, long long produced) except -1:
        """A dispatched request is over: its slot and KV come back; ``produced`` ≥ 0 is
        learnt as its output length."""
        self.used[p] -= 1
        self.kv[p] -= self.reqs[h].prompt + self.reqs[h].out / 2
        if self.used[p] == 0:
            self.pend[p] = 0.0  # nothing running: nothing waits for prefill
        if produced >= 0:
            self._observe_output(h, produced)
        idt_remove(&self.by_id, self.reqs[h].hash, h)
        self.reqs[h].state = DONE
        self._maybe_release(h)
        return 0
