-- Fewer writes per run: the journal's and the transcript's inserts no longer
-- run a foreign-key check each. A check is a query of its own (SPI) per row
-- inserted, and it locks the parent row FOR KEY SHARE, which writes a WAL
-- record: three per no-op run (`run_started`, `complete`, the answer's
-- message), on top of the two journal events of every enqueue.
--
-- What the two constraints guarded, and what guards it now:
-- - An event whose run does not exist, a message whose conversation does not
--   exist. Every insert takes the parent's id from the parent's row in the
--   same statement (the claim and the ending from the rows they update, the
--   enqueue from the rows it inserts, a fenced append from the run row it
--   locks FOR SHARE, a finalizer from the run row it locked), so no insert
--   can name a missing parent; and a parent is never deleted: runs and
--   conversations stay (retention trims the journal, not the run), and the
--   triggers below refuse a DELETE of either, so no parent can go missing
--   under its children. tests/run_core.rs
--   (`runs_and_conversations_are_never_deleted_so_no_event_or_message_is_orphaned`)
--   shows the refusal; the fault suite checks after every scenario that no
--   event lacks its run and no message its conversation.
-- - Serialisation with the conversation's lock. An enqueue into a named
--   conversation still takes the conversation row FOR KEY SHARE through
--   agent_run's own foreign key (kept), which is what a retry's or a
--   rejecting enqueue's FOR UPDATE of the conversation waits for. An ending's
--   answer no longer waits for such a lock; nothing read under it depends on
--   an ending (the retry reads the run it locked, the rejecting enqueue the
--   conversation's running turn, whose ending is a row update either way).
ALTER TABLE run_event DROP CONSTRAINT run_event_run_id_fkey;
ALTER TABLE message DROP CONSTRAINT message_conversation_id_fkey;

CREATE FUNCTION refuse_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: rows are never deleted (the journal and the transcript refer to them)', TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END
$$;

-- Statement triggers: they cost nothing on an insert or an update.
CREATE TRIGGER agent_run_never_deleted
    BEFORE DELETE ON agent_run FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete();
CREATE TRIGGER conversation_never_deleted
    BEFORE DELETE ON conversation FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete();
