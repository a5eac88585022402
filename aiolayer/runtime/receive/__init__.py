"""D's side of the runtime: transfers registered before they are published, fenced against the P ranks
that write them, ended by DONE, FAILED, abort or deadline."""
