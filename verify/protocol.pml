/* The one-sided dispatch/combine protocol of moeflow/comm (the shm transport), as implemented.
 *
 * docs/protocol_model.md maps each proctype and inline to the code and says what is left out;
 * verify/check.py runs spin on it in the configurations and mutants listed there. Checked by an
 * exhaustive safety run:
 *   - no torn message: a reader that sees flag == seq reads that message's header and payload;
 *   - no lost or duplicated message: every reader takes seq 1, 2, ... of each lane in order,
 *     once each (ProtocolError asserts), and every process ends (a lost message leaves its reader
 *     blocked: an invalid end state);
 *   - no overwrite of an unread slot: no store lands on a slot whose message its reader has not
 *     finished copying (ghost `unread`);
 *   - no deadlock with the configured slot count: every process reaches its end;
 *   - no lost wake-up: a waiter never falls asleep while a message it would take is visible and
 *     that message's ring has already been spent (ghosts `drung`, `crung`).
 *
 * Memory is x86-TSO: each CPU (a process, or a thread of the MoE worker) has a FIFO store buffer
 * of K entries that drains to memory at any time; a load reads the CPU's newest buffered store
 * to its address, else memory; a locked instruction or a futex call (the kernel's smp_mb) drains
 * the caller's buffer first. Each memory access of the Python code is one step.
 *
 * Mutants (-D...), each to show that a check can fail: OLD_RING (the doorbell's read-modify-write
 * ring before the fix), DRAIN_AFTER_POLL (the waiter drains after its re-check), WEAK_ORDER (a
 * younger store may overtake an older one, as on ARM or POWER without release stores).
 */

#ifndef NREG
#define NREG 1          /* R: regions of the MoE worker's dispatch buffer (attention DP groups) */
#endif
#ifndef W
#define W 2             /* lanes per region (TP members of a group) */
#endif
#ifndef S
#define S 2             /* slots per lane: CommSpec.num_slots */
#endif
#ifndef NMSG
#define NMSG 3          /* messages each lane writer sends: > S, so slots are reused */
#endif
#ifndef MAXF
#define MAXF S          /* a lane writer's batches in flight (transport.py's contract: <= num_slots) */
#endif
#ifndef THREADS
#define THREADS 1       /* 1: the MoE worker receives and sends on two threads (ThreadedLoop); 0: InlineLoop */
#endif
#ifndef K
#define K 2             /* store-buffer entries per CPU */
#endif
#if K > 2
#error "pending() below looks at two store-buffer entries"
#endif

#define L (NREG * W)                    /* lane writers, and combine buffers */
#define RECV_CPU L                      /* CPUs: lane writers 0 .. L-1, then the MoE worker's threads */
#if THREADS
#define SEND_CPU (L + 1)
#define NCPU (L + 2)
#else
#define SEND_CPU RECV_CPU
#define NCPU (L + 1)
#endif
#define NBELL (L + 1)                   /* bell 0: the dispatch buffer's; bell 1 + l: lane l's combine buffer */

/* Addresses. A buffer starts with its doorbell word; a slot is 2 words, its flag and its data
 * (the header and the payload: stored before the flag, loaded after it). */
#define DBELL 0
#define DFLAG(l, s) (1 + ((l) * S + (s)) * 2)
#define CBASE(l) (1 + L * S * 2 + (l) * (1 + S * 2))
#define CBELL(l) CBASE(l)
#define CFLAG(l, s) (CBASE(l) + 1 + (s) * 2)
#define NADDR CBASE(L)
#define NSLOTID (2 * L * S)             /* ghost slot ids: dispatch l*S + s, then combine L*S + l*S + s */

/* Message data: a value of (lane, seq), so that a stale, foreign or missing message reads wrong;
 * the reply is derived from what the MoE worker read. */
#define PAYV(l, seq) (16 * ((l) + 1) + (seq))
#define REPLYV(l, seq) (128 + PAYV(l, seq))

byte mem[NADDR];
byte sb_a[NCPU * K]; byte sb_v[NCPU * K]; byte sb_n[NCPU];   /* store buffers, oldest first */
bit asleep[NBELL];              /* the bell's owner is blocked in FUTEX_WAIT */
byte dexp[NREG];                /* MoE worker: next seq of each region (ShmDispatchReceiver._expect) */
byte cexp[L];                   /* lane writer l: next seq of its combine lane (ShmCombineReceiver._expect) */
#if THREADS
chan inbox = [NREG * MAXF] of { byte, byte };   /* receive thread -> send thread: (region, seq) */
#endif

/* ghosts */
bit unread[NSLOTID];            /* the slot's flag is published, its reader's copy not finished */
byte drung[L];                  /* last seq whose ring lane writer l has spent on the dispatch bell */
byte crung[L];                  /* last seq whose ring the MoE worker has spent on lane l's combine bell */
bit lost_wakeup;
hidden byte _a, _v, _i, _j, _r, _sid, _kind, _ok;

/* ---- x86-TSO -------------------------------------------------------------------------------- */

inline classify(ca) {           /* -> _sid, _kind (0 flag, 1 data, 2 doorbell) */
  if
  :: ca == DBELL -> _kind = 2
  :: ca > DBELL && ca < CBASE(0) -> _sid = (ca - 1) / 2; _kind = (ca - 1) % 2
  :: ca >= CBASE(0) ->
     _i = (ca - CBASE(0)) / (1 + S * 2); _r = (ca - CBASE(0)) % (1 + S * 2);
     if
     :: _r == 0 -> _kind = 2
     :: else -> _sid = L * S + _i * S + (_r - 1) / 2; _kind = (_r - 1) % 2
     fi
  fi
}

inline flush_at(fc, fx) {       /* entry fx of CPU fc's store buffer reaches memory */
  _a = sb_a[fc * K + fx]; _v = sb_v[fc * K + fx];
  classify(_a);
  if
  :: _kind == 0 && _v != 0 -> assert(!unread[_sid]); unread[_sid] = 1   /* publishes over an unread message? */
  :: _kind == 1 -> assert(!unread[_sid])                                /* overwrites an unread message? */
  :: else -> skip
  fi;
  mem[_a] = _v;
  printf("      cpu %d: [%d] = %d reaches memory\n", fc, _a, _v);
  _i = fx + 1;
  do
  :: _i < sb_n[fc] -> sb_a[fc * K + _i - 1] = sb_a[fc * K + _i]; sb_v[fc * K + _i - 1] = sb_v[fc * K + _i]; _i++
  :: else -> break
  od;
  sb_n[fc]--; sb_a[fc * K + sb_n[fc]] = 0; sb_v[fc * K + sb_n[fc]] = 0;
  _a = 0; _v = 0; _i = 0; _r = 0; _sid = 0; _kind = 0
}

inline fence(nc) {              /* a locked instruction, or the kernel's smp_mb in a futex call */
  do
  :: sb_n[nc] > 0 -> flush_at(nc, 0)
  :: else -> break
  od
}

inline store(sc, sa, sv) {
  d_step {
    sb_n[sc] < K -> sb_a[sc * K + sb_n[sc]] = sa; sb_v[sc * K + sb_n[sc]] = sv; sb_n[sc]++;
    printf("cpu %d: stores [%d] = %d\n", sc, sa, sv);
#ifdef SC
    flush_at(sc, 0)                     /* no store buffer: sequential consistency */
#else
    skip
#endif
  }
}

inline load_in(lc, la, ldst) {  /* store forwarding: the CPU's newest buffered store, else memory */
  ldst = mem[la]; _i = 0;
  do
  :: _i < sb_n[lc] -> if :: sb_a[lc * K + _i] == la -> ldst = sb_v[lc * K + _i] :: else -> skip fi; _i++
  :: else -> break
  od;
  _i = 0
}

inline load(lc, la, ldst) {
  d_step { load_in(lc, la, ldst) }
}

/* CPU c has a store to address a in its buffer (K <= 2) */
#define pending(c, a) ((sb_n[c] > 0 && sb_a[(c) * K] == (a)) || (sb_n[c] > 1 && sb_a[(c) * K + 1] == (a)))

proctype StoreBuffer(byte c) {
end:
  do
  :: d_step { sb_n[c] > 0 -> flush_at(c, 0) }
#ifdef WEAK_ORDER
  :: d_step { sb_n[c] > 1 && sb_a[c * K + 1] != sb_a[c * K] -> flush_at(c, 1) }
#endif
  od
}

/* ---- doorbell.py: FutexDoorbell --------------------------------------------------------------- */

inline check_lost(kb) {         /* bell kb's waiter falls asleep: must a ring still come? */
  if
  :: kb == 0 ->                 /* dispatch: a complete region each of whose lanes has rung */
     _r = 0;
     do
     :: _r < NREG ->
        _ok = 1; _j = 0;
        do
        :: _j < W ->
           if
           :: mem[DFLAG(_r * W + _j, dexp[_r] % S)] != dexp[_r] || drung[_r * W + _j] < dexp[_r] -> _ok = 0
           :: else -> skip
           fi;
           _j++
        :: else -> break
        od;
        if :: _ok -> lost_wakeup = 1 :: else -> skip fi;
        _r++
     :: else -> break
     od;
     _r = 0; _j = 0; _ok = 0
  :: else ->                    /* combine: the next segment, rung */
     if
     :: mem[CFLAG(kb - 1, cexp[kb - 1] % S)] == cexp[kb - 1] && crung[kb - 1] >= cexp[kb - 1] -> lost_wakeup = 1
     :: else -> skip
     fi
  fi;
  assert(!lost_wakeup)
}

inline futex_wait(wc, wa, wb, wseen) {  /* FutexDoorbell.wait: FUTEX_WAIT(word, seen), no timeout */
  atomic {
    fence(wc);
    if
    :: mem[wa] == wseen ->                                  /* compared under the futex bucket lock */
       printf("cpu %d: FUTEX_WAIT: word [%d] still %d: sleeps\n", wc, wa, wseen);
       check_lost(wb); asleep[wb] = 1
    :: else -> printf("cpu %d: FUTEX_WAIT: word [%d] is %d: EAGAIN\n", wc, wa, mem[wa])
    fi
  }
  asleep[wb] == 0                       /* until a FUTEX_WAKE */
}

#ifdef OLD_RING
/* self._cell.value = (self._cell.value + 1) & 0x7FFFFFFF, then FUTEX_WAKE */
inline ring(rc, ra, rb, rrung, rseq) {
  d_step { load_in(rc, ra, t); printf("cpu %d: ring: loads word [%d] = %d\n", rc, ra, t) }
  store(rc, ra, t + 1);
  t = 0;
  atomic { fence(rc); asleep[rb] = 0; rrung = rseq; printf("cpu %d: ring: FUTEX_WAKE [%d]\n", rc, ra) }
}
#else
/* FUTEX_WAKE_OP(word, word, FUTEX_OP_ADD 1): the kernel adds and wakes under the bucket lock */
inline ring(rc, ra, rb, rrung, rseq) {
  atomic {
    fence(rc); mem[ra] = mem[ra] + 1; asleep[rb] = 0; rrung = rseq;
    printf("cpu %d: ring: FUTEX_WAKE_OP adds: word [%d] = %d, wakes\n", rc, ra, mem[ra])
  }
}
#endif

/* ---- wait.py: wait_for(poll, bell, policy) -------------------------------------------------- */

/* Time is not modelled. A poll of phases 1-2 (spin, sched_yield) either takes a message, as the
 * re-check after the drain may too, or changes nothing but time: so they are the first POLL, and
 * each round of phase 3 drains, re-checks, then blocks. The block's timeout (the safety net) is
 * left out, so nothing rescues a lost wake-up. */
#define DRAIN(c, a) d_step { load_in(c, a, seen); printf("cpu %d: drain: word [%d] = %d\n", c, a, seen) }
#ifdef DRAIN_AFTER_POLL
#define DRAIN_THEN_CHECK(c, a, POLL) POLL; DRAIN(c, a)
#else
#define DRAIN_THEN_CHECK(c, a, POLL) DRAIN(c, a); POLL
#endif

#define WAIT_FOR(c, a, b, POLL)                                         \
  POLL;                                                                 \
  do                                                                    \
  :: got -> break                                                       \
  :: else ->                                                            \
     DRAIN_THEN_CHECK(c, a, POLL);                                      \
     if :: got -> skip :: else -> futex_wait(c, a, b, seen); POLL fi;   \
     seen = 0                                                           \
  od

/* ---- shm.py: LaneWriter.write ------------------------------------------------------------------ */

inline write(xc, xflag, xseq, xval, xbell, xb, xrung) {
  load(xc, xflag, f);
  if
  :: f != 0 ->
     assert(f + S == xseq);             /* ProtocolError: another writer on this lane? */
     !pending(xc, xflag) && mem[xflag] == 0   /* backpressure: wait_for(flag == 0) with naps */
  :: else -> skip
  fi;
  f = 0;
  store(xc, xflag + 1, xval);           /* write_header, then the payload copy */
  store(xc, xflag, xseq);               /* set_flag: the release point */
  ring(xc, xbell, xb, xrung, xseq)
}

/* ---- shm.py: ShmDispatchReceiver.poll (the region scan) and _take ------------------------------ */

inline dispatch_poll() {
  got = 0; k = 0;
  do
  :: k < NREG ->
     i = (nxt + k) % NREG; seq = dexp[i];
     d_step {                           /* NOTE: one step per region (docs/protocol_model.md) */
       ok = 1; j = 0;
       do
       :: ok && j < W ->                /* all(_ready(...) for j in range(w)) */
          load_in(RECV_CPU, DFLAG(i * W + j, seq % S), f);
          assert(f == 0 || f == seq);   /* ProtocolError */
          if :: f == 0 -> ok = 0 :: else -> skip fi;
          j++
       :: else -> break
       od;
       j = 0;
       do                               /* _take: each lane's header and payload */
       :: ok && j < W ->
          load_in(RECV_CPU, DFLAG(i * W + j, seq % S) + 1, p);
          assert(p == PAYV(i * W + j, seq));    /* torn, stale or foreign? */
          unread[(i * W + j) * S + seq % S] = 0;
          j++
       :: else -> break
       od;
       printf("cpu %d: poll region %d seq %d: %d\n", RECV_CPU, i, seq, ok);
       j = 0; f = 0; p = 0
     }
     if
     :: ok ->
        dexp[i] = seq + 1; nxt = (i + 1) % NREG;
        j = 0;
        do                              /* then every lane's flag is cleared: the writers may write again */
        :: j < W -> store(RECV_CPU, DFLAG(i * W + j, seq % S), 0); j++
        :: else -> break
        od;
        got = 1; break
     :: else -> k++
     fi
  :: else -> break
  od;
  if :: !got -> i = 0; seq = 0 :: else -> skip fi;   /* keep only what was taken */
  k = 0; j = 0; ok = 0
}

/* ---- shm.py: ShmCombineReceiver.poll -------------------------------------------------------- */

inline combine_poll(pme) {
  d_step {
    load_in(pme, CFLAG(pme, cexp[pme] % S), f);
    assert(f == 0 || f == cexp[pme]);   /* ProtocolError */
    got = (f != 0);
    if
    :: got ->                           /* take: header and payload */
       load_in(pme, CFLAG(pme, cexp[pme] % S) + 1, p);
       assert(p == REPLYV(pme, cexp[pme]));     /* torn, stale or foreign? */
       unread[L * S + pme * S + cexp[pme] % S] = 0
    :: else -> skip
    fi;
    printf("cpu %d: poll combine seq %d: %d\n", pme, cexp[pme], got);
    f = 0; p = 0
  }
  if
  :: got -> store(pme, CFLAG(pme, cexp[pme] % S), 0); cexp[pme]++
  :: else -> skip
  fi
}

/* ---- the processes ------------------------------------------------------------------------- */

/* An attention lane writer (workers/stages.py): sends while fewer than MAXF batches are in
 * flight, else receives the oldest one's results: dual-batch interleaving with MAXF = 2,
 * lockstep with 1. */
proctype LaneWriter(byte me) {
  byte sent, recvd, f, p, t, seen;
  bit got;
  do
  :: sent < NMSG && sent < recvd + MAXF ->
     sent++;
     write(me, DFLAG(me, sent % S), sent, PAYV(me, sent), DBELL, 0, drung[me])
  :: else ->
     if
     :: recvd < sent -> WAIT_FOR(me, CBELL(me), 1 + me, combine_poll(me)); recvd++
     :: else -> break
     fi
  od
}

/* experts.py send_replies: one reply per lane of the region */
inline reply(yr, yseq) {
  j = 0;
  do
  :: j < W ->
     write(SEND_CPU, CFLAG(yr * W + j, yseq % S), yseq, REPLYV(yr * W + j, yseq),
           CBELL(yr * W + j), 1 + yr * W + j, crung[yr * W + j]);
     j++
  :: else -> break
  od;
  j = 0
}

#if THREADS
/* workers/moe.py ThreadedLoop: the receive thread takes regions, the send thread replies. */
proctype MoeRecv() {
  byte n, k, i, j, nxt, seq, f, p, seen;
  bit ok, got;
  do
  :: n < NREG * NMSG ->
     WAIT_FOR(RECV_CPU, DBELL, 0, dispatch_poll());
     atomic { fence(RECV_CPU); inbox ! i, seq };    /* queue.put takes a lock: a full fence */
     i = 0; seq = 0; n++
  :: else -> break
  od
}

proctype MoeSend() {
  byte n, r, seq, j, f, t;
  do
  :: n < NREG * NMSG -> inbox ? r, seq; reply(r, seq); r = 0; seq = 0; n++
  :: else -> break
  od
}
#else
/* workers/moe.py InlineLoop: one thread receives, computes and replies in turn. */
proctype MoeWorker() {
  byte n, k, i, j, nxt, seq, f, p, t, seen;
  bit ok, got;
  do
  :: n < NREG * NMSG ->
     WAIT_FOR(RECV_CPU, DBELL, 0, dispatch_poll());
     reply(i, seq);
     i = 0; seq = 0; n++
  :: else -> break
  od
}
#endif

init {
  byte c;
  atomic {
    do
    :: c < NREG -> dexp[c] = 1; c++
    :: else -> break
    od;
    c = 0;
    do
    :: c < L -> cexp[c] = 1; run LaneWriter(c); c++
    :: else -> break
    od;
    c = 0;
    do
    :: c < NCPU -> run StoreBuffer(c); c++
    :: else -> break
    od;
#if THREADS
    run MoeRecv(); run MoeSend();
#else
    run MoeWorker();
#endif
    c = 0
  }
}
