//! The messages of pprof's `profile.proto` (github.com/google/pprof, `proto/`),
//! written out by hand for `prost`: no protoc at build time. Field numbers are
//! the proto's; only what pyprobe writes is declared (a reader skips the rest).

/// A whole profile. String fields are indices into `string_table`, whose first
/// entry is the empty string.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub(crate) sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub(crate) sample: Vec<Sample>,
    #[prost(message, repeated, tag = "4")]
    pub(crate) location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub(crate) string_table: Vec<String>,
    /// Wall-clock time the profile starts, ns since the Unix epoch.
    #[prost(int64, tag = "9")]
    pub(crate) time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub(crate) duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub(crate) period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub(crate) period: i64,
    /// Free-form notes, as string indices.
    #[prost(int64, repeated, tag = "13")]
    pub(crate) comment: Vec<i64>,
    /// The `type` of the sample type viewers show first.
    #[prost(int64, tag = "14")]
    pub(crate) default_sample_type: i64,
}

/// What a value counts (`type`) and in what (`unit`), as string indices.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub(crate) unit: i64,
}

/// One stack, leaf first, with one value per sample type.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    pub(crate) location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub(crate) value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub(crate) label: Vec<Label>,
}

/// A label of a sample: a string (`str`) or a number (`num`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Label {
    #[prost(int64, tag = "1")]
    pub(crate) key: i64,
    #[prost(int64, tag = "2")]
    pub(crate) str: i64,
    #[prost(int64, tag = "3")]
    pub(crate) num: i64,
}

/// A place in the code: here a function, at a line.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Location {
    #[prost(uint64, tag = "1")]
    pub(crate) id: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Line {
    #[prost(uint64, tag = "1")]
    pub(crate) function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub(crate) id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub(crate) system_name: i64,
    #[prost(int64, tag = "4")]
    pub(crate) filename: i64,
    #[prost(int64, tag = "5")]
    pub(crate) start_line: i64,
}
