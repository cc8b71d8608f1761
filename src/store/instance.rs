//! The instance lock's session, on either database: a connection of its own on which the
//! relay holds, for each outbox table it serves, a lock named after its `relay.instance_id`
//! and the table, for as long as it runs (PostgreSQL: a session-level advisory lock; MySQL:
//! `GET_LOCK`). Two relays with one id would renew, settle and hand back each other's rows;
//! with the lock, the second refuses to start. What to do with it (take it at start, keep
//! it, take it again) is [`crate::tasks::instance`]'s.

use super::{Result, Store, mysql, postgres};

/// A database session, as the server knows it: its id (PostgreSQL's backend pid, MySQL's
/// connection id) and, where the server tells, when it started (a PostgreSQL pid alone may be
/// reused; a MySQL connection id is not, until the server restarts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionId {
    /// `pg_backend_pid()` or `CONNECTION_ID()`.
    pub id: i64,
    /// `backend_start` as text (PostgreSQL); empty on MySQL.
    pub started: String,
}

/// The session that holds an instance lock this relay could not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockHolder {
    /// Which session.
    pub session: SessionId,
    /// What the database calls its session ids: `backend pid` or `connection id`.
    pub id_name: &'static str,
    /// Its `application_name` (PostgreSQL; empty when not visible to this role) or its user.
    pub application_name: String,
    /// Its client's address (empty: a local socket, or not visible to this role).
    pub client_addr: String,
}

impl std::fmt::Display for LockHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.id_name, self.session.id)?;
        if !self.application_name.is_empty() {
            write!(f, ", application_name {:?}", self.application_name)?;
        }
        if !self.client_addr.is_empty() {
            write!(f, ", from {}", self.client_addr)?;
        }
        if !self.session.started.is_empty() {
            write!(f, ", connected since {}", self.session.started)?;
        }
        Ok(())
    }
}

/// A session of its own holding this relay's instance locks in one database; dropping it
/// ends the session, which releases every lock it holds.
pub enum LockSession {
    /// On PostgreSQL.
    Postgres(postgres::LockSession),
    /// On MySQL or MariaDB.
    Mysql(mysql::LockSession),
}

impl LockSession {
    /// Which session this is.
    pub fn session(&self) -> &SessionId {
        match self {
            Self::Postgres(s) => s.session(),
            Self::Mysql(s) => s.session(),
        }
    }

    /// When it was made (a PostgreSQL read-only refusal after this leaves it stale:
    /// [`Store::stale_since`]).
    pub fn made(&self) -> std::time::Instant {
        match self {
            Self::Postgres(s) => s.made(),
            Self::Mysql(s) => s.made(),
        }
    }

    /// Whether the session still answers: its locks are held as long as it does.
    pub async fn check(&self) -> Result<()> {
        match self {
            Self::Postgres(s) => s.check().await,
            Self::Mysql(s) => s.check().await,
        }
    }

    /// Takes the instance lock of `store`'s table for `store`'s instance id on this session:
    /// `Ok`, or the session that holds it (`None` if it let go meanwhile; ask again). The
    /// table must exist; `store` must be of the session's database.
    pub async fn lock(&self, store: &Store) -> Result<std::result::Result<(), Option<LockHolder>>> {
        match (self, store) {
            (Self::Postgres(s), Store::Postgres(store)) => s.lock(store).await,
            (Self::Mysql(s), Store::Mysql(store)) => s.lock(store).await,
            _ => Err(super::StoreError::Build(
                "an instance lock session is used with a store of another database".into(),
            )),
        }
    }
}

impl Store {
    /// A session of its own to hold this relay's instance locks in the store's database
    /// ([`LockSession::lock`]).
    pub async fn lock_session(&self) -> Result<LockSession> {
        Ok(match self {
            Store::Postgres(s) => LockSession::Postgres(s.lock_session().await?),
            Store::Mysql(s) => LockSession::Mysql(s.lock_session().await?),
        })
    }

    /// Whether the server refused one of the relay's writes as read-only after `made`: the
    /// sessions made before then are to be given up (PostgreSQL; a MySQL session that meets a
    /// read-only server fails with an outage error instead).
    pub fn stale_since(&self, made: std::time::Instant) -> bool {
        match self {
            Store::Postgres(s) => s.stale_sessions().is_stale(made),
            Store::Mysql(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_names_what_the_role_may_see() {
        let mut holder = LockHolder {
            session: SessionId {
                id: 4242,
                started: "2026-11-29 06:00:00.1+00".into(),
            },
            id_name: "backend pid",
            application_name: "outbox-relay".into(),
            client_addr: "10.0.0.7".into(),
        };
        assert_eq!(
            holder.to_string(),
            "backend pid 4242, application_name \"outbox-relay\", from 10.0.0.7, connected since 2026-11-29 06:00:00.1+00"
        );
        holder.application_name.clear();
        holder.client_addr.clear();
        holder.session.started.clear();
        holder.id_name = "connection id";
        assert_eq!(holder.to_string(), "connection id 4242");
    }
}
