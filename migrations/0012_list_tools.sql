-- A 0.2.0 guest's list-tools is recorded in a resumable run's call log
-- like check-cancel and the clocks (its answer replayed on a resumed attempt).
ALTER TABLE run_call DROP CONSTRAINT run_call_import_check;
ALTER TABLE run_call ADD CONSTRAINT run_call_import_check
    CHECK (import IN ('call-tool', 'check-cancel', 'wall-clock', 'monotonic-clock', 'list-tools'));
