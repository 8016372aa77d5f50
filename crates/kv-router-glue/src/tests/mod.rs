//! Unit and integration tests of the crate (one test binary keeps linking cheap).

mod advisor;
mod calibration;
mod cost;
mod event_plane;
mod hint_validation;
mod kv_events;
mod nats;
mod nats_permissions;
mod pin_accept;
mod service;
mod settings;
