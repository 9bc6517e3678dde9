-- The function that runs a batch of executions: see BatchFunction in
-- batch.rs, which puts the type of account.acct_id for each t in braces,
-- the function's schema-qualified name (a digest of this text) for name,
-- and the schema idem's tables are in for schema.
CREATE FUNCTION {name}(
  p_c text[], p_e text[], p_k text[], p_tok text[], p_src text[], p_dst text[],
  p_s_on bool[], p_s_lo bigint[], p_s_hi bigint[], p_d_on bool[], p_d_lo bigint[], p_d_hi bigint[],
  p_amount bigint[], p_currency text[], p_at text[], p_status int[], p_reason text[], p_body text[],
  p_head text)
RETURNS TABLE (o_held bool, o_premises bool, o_inexact text, o_transfer bigint, o_done bigint, o_alone bool)
LANGUAGE plpgsql SET search_path = {schema}, pg_temp SET enable_seqscan = off AS $body$
DECLARE
  v_n int := coalesce(cardinality(p_k), 0);
  v_seq regclass := pg_get_serial_sequence('transfer', 'transfer_id');
  v_held int[];
  -- each transfer's premises, inexact accounts, transfer id, and whether
  -- it is paid: set afresh by each pass
  v_p bool[];
  v_x text[];
  v_t bigint[];
  v_go bool[];
  v_alone bool[] := array_fill(false, ARRAY[v_n]);
  v_ours int[];
  -- the batch's keys in key order, the order every batch locks them in
  v_order int[] := ARRAY(SELECT o.n FROM unnest(p_c, p_e, p_k) WITH ORDINALITY AS o (c, e, k, n)
                         ORDER BY o.c, o.e, o.k);
  v_busy {t}[] := '{}';
  v_premises bool;
  v_inexact text;
  v_wait text := current_setting('lock_timeout');
  i int;
  v_pass int;
BEGIN
  IF v_seq IS NULL THEN
    RAISE EXCEPTION 'transfer.transfer_id draws from no sequence';
  END IF;
  -- Every key the batch still holds (in key order), then every account it
  -- touches (ascending), as a single execution locks them: batches side by
  -- side never wait on each other in a cycle. A wait past a short bound is
  -- another session's lock (a back-office edit, a session idle in a
  -- transaction), not a batch's: then the batch takes only what is free,
  -- and each transfer whose key or account is held elsewhere is handed
  -- back to go alone (o_alone), where it waits as any single transfer
  -- does, holding up no batch-mate and no lane.
  --
  -- The locks are taken in the same subtransaction (the block) as the
  -- writes: a row locked in a subtransaction and updated by its parent
  -- gets a MultiXact, which every later look at the row then resolves (on
  -- a hot pair, a third of the server's CPU).
  --
  -- Every statement looks rows up by their whole primary key, with scans
  -- of whole tables off (the function's SET): a plan is cached once per
  -- session, and one cached while idem_key was small would scan it whole
  -- (a fresh deployment's first minute: p50 3 -> 70 ms at 700 transfers/s)
  -- until autovacuum's first ANALYZE. A join of the batch's arrays with
  -- the table is no way round it: its cached plan reads the whole index.
  <<attempt>>
  FOR v_pass IN 1 .. 2 LOOP
    BEGIN
      v_p := array_fill(false, ARRAY[v_n]);
      v_x := array_fill(NULL::text, ARRAY[v_n]);
      v_t := array_fill(NULL::bigint, ARRAY[v_n]);
      v_go := array_fill(false, ARRAY[v_n]);
      v_held := '{}';
      IF v_pass = 1 THEN
        PERFORM set_config('lock_timeout', '{wait}', true);
        FOREACH i IN ARRAY v_order LOOP
          PERFORM FROM idem_key x
           WHERE x.client_id = p_c[i] AND x.endpoint = p_e[i] AND x.idem_key = p_k[i]
             AND x.state = 'in_progress' AND x.token = p_tok[i]
             FOR UPDATE;
          IF FOUND THEN
            v_held := v_held || i;
          END IF;
        END LOOP;
        PERFORM 1 FROM account a
         WHERE a.acct_id = ANY (p_src::{t}[] || p_dst::{t}[])
         ORDER BY a.acct_id
         FOR UPDATE;
        PERFORM set_config('lock_timeout', v_wait, true);
      ELSE
        v_ours := '{}';
        FOREACH i IN ARRAY v_order LOOP
          PERFORM FROM idem_key x
           WHERE x.client_id = p_c[i] AND x.endpoint = p_e[i] AND x.idem_key = p_k[i]
             AND x.state = 'in_progress' AND x.token = p_tok[i]
             FOR UPDATE SKIP LOCKED;
          IF FOUND THEN
            v_held := v_held || i;
          -- a key this batch holds by the row, whose lock another session has
          ELSIF EXISTS (SELECT FROM idem_key x
                         WHERE x.client_id = p_c[i] AND x.endpoint = p_e[i] AND x.idem_key = p_k[i]
                           AND x.state = 'in_progress' AND x.token = p_tok[i]) THEN
            v_ours := v_ours || i;
          END IF;
        END LOOP;
        SELECT coalesce(array_agg(a.acct_id), '{}') INTO v_busy FROM account a
         WHERE a.acct_id = ANY (p_src::{t}[] || p_dst::{t}[])
           AND a.acct_id <> ALL (ARRAY(
             SELECT f.acct_id FROM account f
              WHERE f.acct_id = ANY (p_src::{t}[] || p_dst::{t}[])
              ORDER BY f.acct_id
              FOR UPDATE SKIP LOCKED));
        FOR i IN 1 .. v_n LOOP
          v_alone[i] := i = ANY (v_ours) OR p_src[i]::{t} = ANY (v_busy) OR p_dst[i]::{t} = ANY (v_busy);
        END LOOP;
      END IF;
      FOR i IN 1 .. v_n LOOP
        CONTINUE WHEN v_alone[i];
        SELECT coalesce(bool_and(CASE WHEN l.acct_id IS NULL THEN NOT w.present ELSE w.present AND COALESCE(l.balance BETWEEN w.lo AND w.hi, false) END), false),
               string_agg(CASE WHEN l.acct_id IS NULL OR w.delta = 0 OR NOT COALESCE(l.balance BETWEEN w.lo AND w.hi, false) THEN NULL
                               WHEN (l.balance + w.delta)::text::numeric <> l.balance::text::numeric + w.delta
                               THEN l.acct_id::text END, ',')
          INTO v_premises, v_inexact
          FROM (VALUES (p_src[i]::{t}, p_s_on[i], p_s_lo[i], p_s_hi[i], -p_amount[i]),
                       (p_dst[i]::{t}, p_d_on[i], p_d_lo[i], p_d_hi[i], p_amount[i]))
               AS w (id, present, lo, hi, delta)
          LEFT JOIN account l ON l.acct_id = w.id;
        v_p[i] := v_premises;
        v_x[i] := v_inexact;
        v_go[i] := i = ANY (v_held) AND v_premises AND v_inexact IS NULL;
        IF v_go[i] AND p_amount[i] > 0 THEN
          UPDATE account a SET balance = a.balance + w.delta
            FROM (VALUES (p_src[i]::{t}, -p_amount[i]), (p_dst[i]::{t}, p_amount[i])) AS w (id, delta)
           WHERE a.acct_id = w.id;
          v_t[i] := nextval(v_seq);
        END IF;
      END LOOP;
      INSERT INTO transfer (transfer_id, src, dst, amount, currency, created_at)
      SELECT u.tid, u.src::{t}, u.dst::{t}, u.amount, u.currency, u.at
        FROM unnest(v_t, p_src, p_dst, p_amount, p_currency, p_at) AS u (tid, src, dst, amount, currency, at)
       WHERE u.tid IS NOT NULL;
      FOR i IN 1 .. v_n LOOP
        CONTINUE WHEN NOT v_go[i];
        UPDATE idem_key x SET state = 'completed', status = p_status[i], reason = p_reason[i],
               body = CASE WHEN v_t[i] IS NOT NULL THEN p_head || v_t[i] || p_body[i] ELSE p_body[i] END,
               transfer_id = v_t[i], completed_at = p_at[i]
         WHERE x.client_id = p_c[i] AND x.endpoint = p_e[i] AND x.idem_key = p_k[i]
           AND x.state = 'in_progress' AND x.token = p_tok[i];
      END LOOP;
      EXIT attempt;
    EXCEPTION WHEN lock_not_available THEN
      -- the block's locks, writes and lock_timeout are undone with it; the
      -- second pass takes only what is free, and cannot wait
      IF v_pass = 2 THEN
        RAISE;
      END IF;
    END;
  END LOOP;
  RETURN QUERY
    SELECT g.n = ANY (v_held), v_p[g.n], v_x[g.n], v_t[g.n], v_go[g.n]::int::bigint, v_alone[g.n]
      FROM generate_series(1, v_n) AS g (n)
     ORDER BY g.n;
END
$body$
