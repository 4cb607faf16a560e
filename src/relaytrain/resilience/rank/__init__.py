"""What runs inside a rank: the stop agreement and early signals, the watchdog and hard deadline, the NaN
guard, the stack signal, the straggler watch, and `Supervision`, the one front the loop faces for them."""
