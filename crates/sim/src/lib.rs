pub mod linearizability;
