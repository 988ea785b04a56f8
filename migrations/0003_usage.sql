-- Model tokens a run used (model calls, prompt and completion tokens), written
-- with its ending; null when it made no model call.
ALTER TABLE agent_run ADD COLUMN usage jsonb;
