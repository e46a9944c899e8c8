//! Probe sites that write to a shared ring instead of stopping the target.
