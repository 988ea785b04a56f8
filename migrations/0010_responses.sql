-- The Responses API (`/v1/responses`) is a view of runs: a response is a run,
-- its request kept in the run's config, its stream derived from the journal.
-- The one thing the view adds is deletion: `DELETE /v1/responses/{id}` hides
-- the response from every later read (the run, its transcript and its journal
-- stay, so the conversation's history is unchanged).
CREATE TABLE response_deleted (
    run_id     uuid PRIMARY KEY REFERENCES agent_run (id) ON DELETE CASCADE,
    deleted_at timestamptz NOT NULL DEFAULT now()
);
