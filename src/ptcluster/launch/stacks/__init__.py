"""Every rank's stack, from the guards: collected (``collector``) and grouped into the report that
names the straggler first (``report``)."""
