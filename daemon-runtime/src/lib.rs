//! What both Tessera daemons share at run time.
