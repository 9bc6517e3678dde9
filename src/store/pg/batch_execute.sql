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
LANGUAGE plpgsql SET search_path = {schema}, pg_temp AS $body$
DECLARE
  v_n int := coalesce(cardinality(p_k), 0);
  v_seq regclass := pg_get_serial_sequence('transfer', 'transfer_id');
  v_held int[];
  v_p bool[] := array_fill(false, ARRAY[v_n]);
  v_x text[] := array_fill(NULL::text, ARRAY[v_n]);
  v_t bigint[] := array_fill(NULL::bigint, ARRAY[v_n]);
  v_go bool[] := array_fill(false, ARRAY[v_n]);
  v_alone bool[] := array_fill(false, ARRAY[v_n]);
  v_ours int[];
  v_busy {t}[] := '{}';
  v_premises bool;
  v_inexact text;
  v_wait text := current_setting('lock_timeout');
  i int;
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
  -- The statements on idem_key that run in every batch are planned at each
  -- call (EXECUTE), not once per session: a plan cached while the table
  -- was small scans it whole, and went on doing so as it grew, until
  -- autovacuum's first ANALYZE (a fresh deployment's first minute: p50
  -- 3 -> 70 ms at 700 transfers/s).
  BEGIN
    PERFORM set_config('lock_timeout', '{wait}', true);
    EXECUTE $q$
      SELECT coalesce(array_agg(h.n), '{}') FROM (
        SELECT w.n FROM idem_key x
          JOIN unnest($1, $2, $3, $4) WITH ORDINALITY AS w (c, e, k, tok, n)
            ON x.client_id = w.c AND x.endpoint = w.e AND x.idem_key = w.k
         WHERE x.state = 'in_progress' AND x.token = w.tok
         ORDER BY x.client_id, x.endpoint, x.idem_key
         FOR UPDATE OF x) h$q$
      INTO v_held USING p_c, p_e, p_k, p_tok;
    PERFORM 1 FROM account a
     WHERE a.acct_id = ANY (p_src::{t}[] || p_dst::{t}[])
     ORDER BY a.acct_id
     FOR UPDATE;
    PERFORM set_config('lock_timeout', v_wait, true);
  EXCEPTION WHEN lock_not_available THEN
    -- the block's locks and its lock_timeout are undone with it
    SELECT coalesce(array_agg(h.n), '{}') INTO v_held FROM (
      SELECT w.n FROM idem_key x
        JOIN unnest(p_c, p_e, p_k, p_tok) WITH ORDINALITY AS w (c, e, k, tok, n)
          ON x.client_id = w.c AND x.endpoint = w.e AND x.idem_key = w.k
       WHERE x.state = 'in_progress' AND x.token = w.tok
       ORDER BY x.client_id, x.endpoint, x.idem_key
       FOR UPDATE OF x SKIP LOCKED) h;
    -- keys this batch holds by the row, whose lock another session has
    SELECT coalesce(array_agg(w.n), '{}') INTO v_ours FROM idem_key x
      JOIN unnest(p_c, p_e, p_k, p_tok) WITH ORDINALITY AS w (c, e, k, tok, n)
        ON x.client_id = w.c AND x.endpoint = w.e AND x.idem_key = w.k
     WHERE x.state = 'in_progress' AND x.token = w.tok AND NOT w.n = ANY (v_held);
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
  END;
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
  EXECUTE $q$
    UPDATE idem_key x SET state = 'completed', status = u.status, reason = u.reason,
           body = CASE WHEN u.tid IS NOT NULL THEN $11 || u.tid || u.body ELSE u.body END,
           transfer_id = u.tid, completed_at = u.at
      FROM unnest($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
           AS u (c, e, k, tok, status, reason, body, at, tid, go)
     WHERE u.go AND x.client_id = u.c AND x.endpoint = u.e AND x.idem_key = u.k
       AND x.state = 'in_progress' AND x.token = u.tok$q$
    USING p_c, p_e, p_k, p_tok, p_status, p_reason, p_body, p_at, v_t, v_go, p_head;
  RETURN QUERY
    SELECT g.n = ANY (v_held), v_p[g.n], v_x[g.n], v_t[g.n], v_go[g.n]::int::bigint, v_alone[g.n]
      FROM generate_series(1, v_n) AS g (n)
     ORDER BY g.n;
END
$body$
