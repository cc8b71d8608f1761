//! Background services that run beside the relay loop, one file each.

pub mod vacuum;
