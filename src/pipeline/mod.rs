//! The worker pipeline, in the order a message travels it. [`worker`] wires the stages and runs
//! the start-up and shutdown sequences; [`message`] holds what one stage hands the next.
//!
//! * [`source`]: Pub/Sub streaming pull in, parsed [`message::Delivery`]s out (the message data
//!   contract is [`crate::record`]);
//! * [`batcher`]: deliveries into bounded, length-grouped [`message::Batch`]es;
//! * [`infer`]: batches to [`message::Outcome`]s through the one model seam
//!   ([`crate::model::Infer`]): it knows no task and no engine;
//! * [`sink`]: one transaction per outcome, then the acks;
//! * [`ack`]: the ack that travels with each message (dropping it NACKs), and how every message
//!   ends, at shutdown too: the one description of the worker's settlement and shutdown;
//! * [`window`]: how much the worker holds (a few seconds of its model's work);
//! * [`fault`]: injected panics for the tests (debug builds only).
//!
//! Every stage watches the [`crate::shutdown`] token it is handed.

pub mod ack;
pub mod batcher;
pub mod fault;
pub mod infer;
pub mod message;
pub mod sink;
pub mod source;
#[cfg(test)]
pub(crate) mod testkit;
pub mod window;
pub mod worker;
